#!/usr/bin/env bash
# Local Airflow for this checkout: AIRFLOW_HOME=.local/airflow, dags/ as the DAG
# folder, no example DAGs, and connections to the local stack as AIRFLOW_CONN_*.
#
#   scripts/airflow.sh env     write .local/airflow.env (mode 600; source it)
#   scripts/airflow.sh init    env + `airflow db migrate`
#   scripts/airflow.sh start   api-server, scheduler, dag-processor, triggerer
#                              (LocalExecutor, metadata in the local PostgreSQL)
#   scripts/airflow.sh stop    stop what `start` started (by its PID files)
#   scripts/airflow.sh status  one line per service
#
# Spark: the connection spark_default runs the apps on local[*] (no daemon) unless
# EOS_SPARK_MASTER=cluster, which points it at the local standalone master that
# `scripts/stack.sh start-spark` runs (spark://$EOS_BIND_HOST:$EOS_SPARK_MASTER_PORT).
# Not remembered: every env/init/start without it writes local[*] again.
#
# Metadata database: SQLite (.local/airflow/airflow.db) unless
# EOS_AIRFLOW_METADATA=postgres, which uses database $EOS_AIRFLOW_PG_DB on the
# local stack's PostgreSQL. Airflow 3 does not run LocalExecutor on SQLite, so
# `start` always switches to PostgreSQL (and rewrites airflow.env to match).
# SQLite is enough for `airflow db migrate`, DAG parsing and `dag.test()`.
#
# A second deployment beside the first (the tests' dag.test() runs use one, so that they never share
# a metadata database, a definition folder or a lineage file with the demo's running services):
#   EOS_AIRFLOW_HOME=DIR EOS_AIRFLOW_ENV_FILE=FILE EOS_AIRFLOW_DEPLOYMENT_DIR=DIR EOS_AIRFLOW_PG_DB=NAME
# (the deployment dir holds pipelines/, snapshots/, openlineage/ and the checkpoints; default
# $EOS_STATE_DIR). `init` creates the PostgreSQL database when the metadata is postgres.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/config.sh
source "$here/config.sh"

: "${EOS_AIRFLOW_HOME:=$EOS_STATE_DIR/airflow}"
: "${EOS_AIRFLOW_DEPLOYMENT_DIR:=$EOS_STATE_DIR}"
env_file="${EOS_AIRFLOW_ENV_FILE:-$EOS_STATE_DIR/airflow.env}"
# Default: the mode the existing env file was written with, else SQLite.
if [ -z "${EOS_AIRFLOW_METADATA:-}" ] && [ -f "$env_file" ]; then
  EOS_AIRFLOW_METADATA=$(sed -n 's/^export EOS_AIRFLOW_METADATA=//p' "$env_file")
fi
: "${EOS_AIRFLOW_METADATA:=sqlite}"
case "$EOS_AIRFLOW_METADATA" in sqlite|postgres) ;; *) echo "airflow: EOS_AIRFLOW_METADATA must be sqlite or postgres" >&2; exit 2 ;; esac
: "${EOS_AIRFLOW_PG_DB:=airflow}"
: "${EOS_SPARK_MASTER:=local}"
case "$EOS_SPARK_MASTER" in local|cluster) ;; *) echo "airflow: EOS_SPARK_MASTER must be local or cluster" >&2; exit 2 ;; esac
: "${EOS_AIRFLOW_API_PORT:=18080}"
run_dir="$EOS_AIRFLOW_HOME/run"
services=(api-server scheduler dag-processor triggerer)

die() { echo "airflow: $*" >&2; exit 1; }
log() { echo "airflow: $*"; }

[ -x "$EOS_VENV/bin/airflow" ] || die "$EOS_VENV/bin/airflow is missing: run scripts/install.sh"

write_env() {
  mkdir -p "$EOS_AIRFLOW_HOME"
  # The stack's own view of itself wins; config.sh's values are the fallback.
  local kafka_bootstrap="$EOS_BIND_HOST:$EOS_KAFKA_PORT" pg_host="$EOS_BIND_HOST" spark_jars=""
  if [ -f "$EOS_STATE_DIR/stack.env" ]; then
    # shellcheck disable=SC1091
    kafka_bootstrap=$(source "$EOS_STATE_DIR/stack.env" && echo "$EOS_KAFKA_BOOTSTRAP")
    spark_jars=$(source "$EOS_STATE_DIR/stack.env" && echo "$EOS_SPARK_JARS")
    pg_host=$(source "$EOS_STATE_DIR/stack.env" && echo "$EOS_PG_HOST")
  fi
  local secret_file="$EOS_AIRFLOW_HOME/jwt.secret"
  [ -s "$secret_file" ] || (umask 077; head -c 32 /dev/urandom | base64 | tr -d '/+=' > "$secret_file")
  local ui_passwords="$EOS_AIRFLOW_HOME/ui-passwords.json"
  [ -s "$ui_passwords" ] || (umask 077; printf '{"admin": "%s"}\n' "$(head -c 12 /dev/urandom | base64 | tr -d '/+=')" > "$ui_passwords")
  # Values go through the environment into Python, never onto a command line.
  (umask 077
   EOS_KAFKA_BOOTSTRAP="$kafka_bootstrap" EOS_PG_HOST="$pg_host" EOS_SPARK_JARS="$spark_jars" \
   EOS_AIRFLOW_HOME="$EOS_AIRFLOW_HOME" EOS_AIRFLOW_DEPLOYMENT_DIR="$EOS_AIRFLOW_DEPLOYMENT_DIR" \
   EOS_AIRFLOW_METADATA="$EOS_AIRFLOW_METADATA" EOS_AIRFLOW_PG_DB="$EOS_AIRFLOW_PG_DB" \
   EOS_AIRFLOW_API_PORT="$EOS_AIRFLOW_API_PORT" EOS_JWT_SECRET_FILE="$secret_file" \
   EOS_SPARK_MASTER="$EOS_SPARK_MASTER" \
   "$EOS_VENV/bin/python" - > "$env_file.tmp" <<'PY'
import json
import os
import shlex
import sys
from urllib.parse import quote

e = os.environ
home = e["EOS_AIRFLOW_HOME"]
deployment = e["EOS_AIRFLOW_DEPLOYMENT_DIR"]  # definitions, snapshots, lineage, checkpoints
pg = {
    "host": e["EOS_PG_HOST"],
    "port": int(e["EOS_PG_PORT"]),
    "login": e["EOS_PG_USER"],
    "password": e["EOS_PG_PASSWORD"],
}
if e["EOS_AIRFLOW_METADATA"] == "postgres":
    metadata = (
        f"postgresql+psycopg2://{quote(pg['login'], safe='')}:{quote(pg['password'], safe='')}"
        f"@{pg['host']}:{pg['port']}/{e['EOS_AIRFLOW_PG_DB']}"
    )
    executor = "LocalExecutor"
else:
    metadata = f"sqlite:///{home}/airflow.db"
    # Fine for db migrate, parsing and dag.test(); the services need postgres.
    executor = "LocalExecutor"
api = f"http://{e['EOS_BIND_HOST']}:{e['EOS_AIRFLOW_API_PORT']}"
with open(e["EOS_JWT_SECRET_FILE"]) as f:
    jwt_secret = f.read().strip()
values = {
    "EOS_AIRFLOW_METADATA": e["EOS_AIRFLOW_METADATA"],
    "AIRFLOW_HOME": home,
    "AIRFLOW__CORE__DAGS_FOLDER": os.path.join(e["EOS_ROOT"], "dags"),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    # Each task parses the DAG file at its start (about 2 s at rest). On this one machine three
    # Spark drivers, Kafka, Connect and PostgreSQL can load 2 cores past 10, and a parse then passed
    # Airflow's 30 s default: the task was rescheduled and the demo's recovery lost a minute.
    "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
    "AIRFLOW__CORE__EXECUTOR": executor,
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": metadata,
    "AIRFLOW__API__BASE_URL": api,
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{api}/execution/",
    "AIRFLOW__API_AUTH__JWT_SECRET": jwt_secret,
    # One UI/API login for the local stack; its password is in ui-passwords.json (mode 600).
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": os.path.join(home, "ui-passwords.json"),
    "AIRFLOW_CONN_KAFKA_DEFAULT": json.dumps(
        {
            "conn_type": "kafka",
            "extra": {"bootstrap.servers": e["EOS_KAFKA_BOOTSTRAP"], "group.id": "eos"},
        }
    ),
    "AIRFLOW_CONN_EOS_POSTGRES": json.dumps({"conn_type": "postgres", "schema": e["EOS_PG_DB"], **pg}),
    "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(
        {"conn_type": "spark", "host": f"spark://{e['EOS_BIND_HOST']}", "port": int(e["EOS_SPARK_MASTER_PORT"])}
        if e["EOS_SPARK_MASTER"] == "cluster" else {"conn_type": "spark", "host": "local[*]"}),
    # The provider's deployment settings ([eos] provider config): the pipeline definitions the DAG
    # factory reads, where snapshots are kept (required: the provider has no default store), and
    # Spark's Kafka connector as resolved by install.sh. (Hanging transactions are found and aborted
    # from Python: Airflow needs no Kafka tools classpath.)
    "AIRFLOW__EOS__PIPELINE_CONFIG_DIR": os.path.join(deployment, "pipelines"),
    "AIRFLOW__EOS__SNAPSHOT_STORE": os.path.join(deployment, "snapshots"),
    "AIRFLOW__EOS__SPARK_JARS": e.get("EOS_SPARK_JARS", ""),
    # OpenLineage (the provider's listener): every event as one JSON line in one file, from which
    # the demo reads topic -> pipeline -> tables and the audit's data-quality facet (docs/lineage.md).
    "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
        {"type": "file", "log_file_path": os.path.join(deployment, "openlineage", "events.jsonl"),
         "append": True}),
    "AIRFLOW__OPENLINEAGE__NAMESPACE": "eos-local",
    # Spark's Python workers use the venv (pyarrow, psycopg2), whatever python3 is on PATH.
    "PYSPARK_PYTHON": os.path.join(e["EOS_VENV"], "bin", "python"),
}
if e["EOS_SPARK_MASTER"] == "cluster":
    # The drivers (spark-submit, client mode) listen on the bind host, as the master and worker do.
    values["SPARK_LOCAL_IP"] = e["EOS_BIND_HOST"]
# The shipped example pipeline's definition (connections are the [eos] defaults: kafka_default,
# eos_postgres, spark_default). Timings are short so that the demo shows them in minutes.
pipelines = os.path.join(deployment, "pipelines")
os.makedirs(pipelines, exist_ok=True)
os.makedirs(os.path.join(deployment, "openlineage"), exist_ok=True)
stale = os.path.join(pipelines, "ledger.json")  # the app-config format of earlier versions
if os.path.exists(stale):
    os.remove(stale)
ledger = {
    "name": "ledger",
    "topics": ["ledger.events"],
    "spec": "spark_apps.ledger.spec:LEDGER",
    "delivery": "exactly_once",
    "target_schema": "public",
    "meta_schema": "eos",
    "checkpoint_dir": os.path.join(deployment, "checkpoints"),
    "stream": {"trigger": "processingTime", "trigger_interval": "2 seconds", "max_offsets_per_trigger": 4000,
               "max_batch_attempts": 2, "restart_backoff": 3, "create_targets": True,
               # The demo spends restarts on purpose: a driver SIGKILL, and the poison batch's
               # failed attempts before it is quarantined. Leave room for one unplanned failure.
               "max_restarts": 6},
    "snapshot": {"schedule": "@hourly", "keep_last": 24},
    # Hourly, not every 5 minutes: the demo triggers its health run right after leaving a transaction
    # open, and a scheduled run (max_active_runs=1) would queue it for up to a sensor window and
    # catch the stuck LSO first, so the demo's run would not show the sensor deferring. Short windows:
    # the demo's open transaction stays open until it is fenced, and a health run lasts about
    # stuck_after + sensor_timeout (the recovery's gate watches for stuck_after too). stuck_after
    # stays well over the 10 s a sensor checks in the worker before it defers, plus a poke: a
    # shorter one is caught in the worker, and the demo would not show the sensor deferring.
    "health": {"schedule": "@hourly", "stuck_after": 20, "poke_interval": 5, "sensor_timeout": 30},
}
# The second shipped pipeline, of another shape (spark_apps/orders), in schemas of its own.
orders = {
    "name": "orders",
    "topics": ["orders.events"],
    "spec": "spark_apps.orders.spec:ORDERS",
    "delivery": "exactly_once",
    "target_schema": "orders",
    "meta_schema": "orders_eos",
    "checkpoint_dir": os.path.join(deployment, "checkpoints-orders"),
    # The continuous engine (one Python process in the stream task, no JVM), as a live sales view
    # would run: a committed order is in the target within a fraction of a second.
    "stream": {"engine": "continuous", "max_offsets_per_trigger": 4000, "restart_backoff": 3,
               "create_targets": True},
    "snapshot": {"schedule": "@hourly", "keep_last": 24},
    "health": {"schedule": "*/5 * * * *", "stuck_after": 15, "poke_interval": 5, "sensor_timeout": 60},
}
# The third, a mirror of the source database's shop schema (demo/cdc_app.py's application, captured
# by Debezium with topic.prefix shop): declarative, its mirror section inline, no Python spec.
sys.path.insert(0, e["EOS_ROOT"])
from demo.cdc_app import change_topics, mirror_definition  # noqa: E402

shop_mirror = {
    "name": "shop_mirror",
    "topics": change_topics("shop", "shop"),
    **mirror_definition("shop", "shop"),
    "delivery": "exactly_once",
    "target_schema": "shop_mirror",
    "meta_schema": "shop_mirror_eos",
    "checkpoint_dir": os.path.join(deployment, "checkpoints-shop"),
    # Spark, the project's engine, 2 s batches; half of the ledger's executor memory, so two
    # streams and the recovery's replay fit the local cluster's worker.
    "stream": {"trigger": "processingTime", "trigger_interval": "2 seconds", "max_offsets_per_trigger": 2000,
               "restart_backoff": 3, "create_targets": True},
    "spark": {"executor_memory": "512m"},
    "snapshot": {"schedule": "@hourly", "keep_last": 24},
    "health": {"schedule": "@hourly", "stuck_after": 15, "poke_interval": 5, "sensor_timeout": 60},
}
if e["EOS_SPARK_MASTER"] == "cluster":
    # The cluster demo shows the recovery's replay as an application of the cluster too; by the
    # default (auto) its ~2000 records would be replayed in the worker, without Spark.
    ledger["stream"]["replay_engine"] = "spark"
for definition in (ledger, orders, shop_mirror):
    with open(os.path.join(pipelines, f"{definition['name']}.yaml"), "w") as f:
        f.write("# Written by scripts/airflow.sh for the local stack; "
                "see airflow_provider_eos/utils/pipeline_definition.py\n")
        json.dump(definition, f, indent=2)  # JSON is YAML
        f.write("\n")
print("# Generated by scripts/airflow.sh env; holds a password: keep it private.")
for key, value in values.items():
    print(f"export {key}={shlex.quote(value)}")
# spark-submit and airflow come from the venv.
print(f'export PATH={shlex.quote(e["EOS_VENV"] + "/bin")}:"$PATH"')
PY
  ) || die "writing $env_file failed"
  mv "$env_file.tmp" "$env_file"
  chmod 600 "$env_file"
  log "wrote $env_file (metadata: $EOS_AIRFLOW_METADATA, spark: $EOS_SPARK_MASTER)"
}

load_env() {
  # shellcheck disable=SC1090
  source "$env_file"
}

migrate() {
  load_env
  mkdir -p "$EOS_AIRFLOW_HOME"
  airflow db migrate > "$EOS_AIRFLOW_HOME/db-migrate.log" 2>&1 \
    || { tail -n 20 "$EOS_AIRFLOW_HOME/db-migrate.log" >&2; die "airflow db migrate failed: see $EOS_AIRFLOW_HOME/db-migrate.log"; }
  log "metadata database migrated ($EOS_AIRFLOW_METADATA)"
}

pg_tool() {  # $1 tool name: the client of the stack's PostgreSQL major
  local bin
  for bin in /usr/lib/postgresql/*/bin; do [ -x "$bin/$1" ] && { echo "$bin/$1"; return; }; done
  die "PostgreSQL client $1 is missing: run scripts/install.sh"
}

ensure_pg_database() {
  local psql; psql=$(pg_tool psql)
  PGPASSWORD="$EOS_PG_PASSWORD" "$psql" -h "$EOS_BIND_HOST" -p "$EOS_PG_PORT" -U "$EOS_PG_USER" -d postgres \
    -tAc "SELECT 1 FROM pg_database WHERE datname = '$EOS_AIRFLOW_PG_DB'" 2>/dev/null | grep -q 1 && return
  PGPASSWORD="$EOS_PG_PASSWORD" "$(pg_tool createdb)" -h "$EOS_BIND_HOST" -p "$EOS_PG_PORT" \
    -U "$EOS_PG_USER" "$EOS_AIRFLOW_PG_DB" \
    || die "cannot create database $EOS_AIRFLOW_PG_DB: is the stack up? (scripts/stack.sh start)"
  log "created database $EOS_AIRFLOW_PG_DB"
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_services() {
  if [ "$EOS_SPARK_MASTER" = cluster ] && ! (exec 3<>"/dev/tcp/$EOS_BIND_HOST/$EOS_SPARK_MASTER_PORT") 2>/dev/null; then
    die "EOS_SPARK_MASTER=cluster but no Spark master listens on $EOS_BIND_HOST:$EOS_SPARK_MASTER_PORT: run scripts/stack.sh start-spark"
  fi
  EOS_AIRFLOW_METADATA=postgres
  ensure_pg_database
  write_env
  migrate
  mkdir -p "$run_dir"
  local svc
  for svc in "${services[@]}"; do
    local pidf="$run_dir/$svc.pid"
    if pid_alive "$pidf"; then log "$svc already running (pid $(cat "$pidf"))"; continue; fi
    local args=("$svc")
    case "$svc" in
      api-server) args+=(--host "$EOS_BIND_HOST" --port "$EOS_AIRFLOW_API_PORT") ;;
      # Their log servers would bind every interface; LocalExecutor's task logs
      # are local files the api-server reads directly.
      scheduler|triggerer) args+=(--skip-serve-logs) ;;
    esac
    # setsid: the services outlive the shell that started them.
    setsid "$EOS_VENV/bin/airflow" "${args[@]}" > "$run_dir/$svc.log" 2>&1 < /dev/null &
    echo $! > "$pidf"
  done
  local deadline=$(( $(date +%s) + 120 ))
  until (exec 3<>"/dev/tcp/$EOS_BIND_HOST/$EOS_AIRFLOW_API_PORT") 2>/dev/null; do
    for svc in "${services[@]}"; do
      pid_alive "$run_dir/$svc.pid" || die "$svc exited during start: see $run_dir/$svc.log"
    done
    [ "$(date +%s)" -lt "$deadline" ] || die "api-server did not listen within 120s: see $run_dir/api-server.log"
    sleep 1
  done
  log "up: api-server on http://$EOS_BIND_HOST:$EOS_AIRFLOW_API_PORT, scheduler, dag-processor, triggerer (logs in $run_dir)"
}

stop_services() {
  local svc
  for svc in "${services[@]}"; do
    local pidf="$run_dir/$svc.pid"
    if pid_alive "$pidf"; then
      local pid; pid=$(cat "$pidf")
      # setsid made each service its own process group: stop the group.
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
      for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null
      log "$svc stopped"
    fi
    rm -f "$pidf"
  done
}

case "${1:-}" in
  env) write_env ;;
  init)
    write_env
    if [ "$EOS_AIRFLOW_METADATA" = postgres ]; then ensure_pg_database; fi
    migrate ;;
  start) start_services ;;
  stop) stop_services ;;
  status)
    for svc in "${services[@]}"; do
      if pid_alive "$run_dir/$svc.pid"; then echo "$svc: running (pid $(cat "$run_dir/$svc.pid"))"; else echo "$svc: stopped"; fi
    done ;;
  *) echo "usage: $0 env|init|start|stop|status" >&2; exit 2 ;;
esac
