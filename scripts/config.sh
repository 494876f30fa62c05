# Shared settings of the local stack; every value can be overridden from the
# environment. Sourced by stack.sh, install.sh and airflow.sh.
EOS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${EOS_STATE_DIR:=$EOS_ROOT/.local}"
: "${EOS_BIND_HOST:=127.0.0.1}"
: "${EOS_KAFKA_PORT:=19092}"
: "${EOS_KAFKA_CONTROLLER_PORT:=19093}"
: "${EOS_KAFKA_SASL_PORT:=19094}"
: "${EOS_KAFKA_SASL_USER:=eos}"
# Broker-side ceiling for a producer's transaction.timeout.ms. A transaction
# open longer than this is no longer timed out by the coordinator ("hanging").
: "${EOS_KAFKA_TXN_MAX_TIMEOUT_MS:=900000}"
# How often the coordinator aborts timed-out transactions (Kafka's default 10s).
: "${EOS_KAFKA_TXN_ABORT_INTERVAL_MS:=1000}"
: "${EOS_PG_PORT:=15432}"
# How long `stack.sh start` waits for the broker. After an unclean stop (a SIGKILL, a crash) it
# recovers the last segment of every partition before it listens: with about a thousand
# partitions on 2 busy cores that took 100 s.
: "${EOS_KAFKA_START_SECONDS:=240}"
: "${EOS_PG_DB:=eos}"
: "${EOS_PG_USER:=eos}"
: "${EOS_PG_MAX_PREPARED:=64}"
: "${EOS_SPARK_MASTER_PORT:=17077}"
: "${EOS_SPARK_MASTER_UI_PORT:=18091}"
: "${EOS_SPARK_WORKER_PORT:=17078}"
: "${EOS_SPARK_WORKER_UI_PORT:=18092}"
# The worker offers what the demo's three small streams need at once (a core each: they wait on
# Kafka and PostgreSQL most of the time, so three fit a 2-core machine).
: "${EOS_SPARK_WORKER_CORES:=3}"
: "${EOS_SPARK_WORKER_MEMORY:=3g}"
# Cores an application gets when it sets no spark.cores.max (the master's spark.deploy.defaultCores).
: "${EOS_SPARK_DEFAULT_CORES:=1}"
: "${EOS_KAFKA_LIBS:=$EOS_STATE_DIR/kafka-libs}"
# Kafka Connect (scripts/stack.sh start-connect): its REST listener, the worker's classpath,
# and plugin.path, where each connector has a folder (and class loader) of its own.
: "${EOS_CONNECT_PORT:=18083}"
: "${EOS_CONNECT_LIBS:=$EOS_STATE_DIR/connect-libs}"
: "${EOS_CONNECT_PLUGIN_PATH:=$EOS_STATE_DIR/connect-plugins}"
# The change-data-capture source: a database of its own on the stack's PostgreSQL (whose
# wal_level is logical), a role that may replicate and read it, and the publication
# Debezium's pgoutput plugin reads. The role's password is random per checkout, in a
# git-ignored mode-600 file.
: "${EOS_SOURCE_PG_DB:=eos_source}"
: "${EOS_SOURCE_PG_USER:=eos_cdc}"
: "${EOS_SOURCE_PUBLICATION:=eos_cdc}"
: "${EOS_SOURCE_PG_PASSWORD_FILE:=$EOS_STATE_DIR/source-pg.password}"
if [ ! -s "$EOS_SOURCE_PG_PASSWORD_FILE" ]; then
  mkdir -p "$(dirname "$EOS_SOURCE_PG_PASSWORD_FILE")"
  (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' > "$EOS_SOURCE_PG_PASSWORD_FILE")
fi
: "${EOS_SPARK_JARS_DIR:=$EOS_STATE_DIR/spark-jars}"
: "${EOS_VENV:=$EOS_ROOT/.venv}"
if [ -z "${EOS_PG_PASSWORD:-}" ]; then
  # A random password per checkout, kept in a git-ignored file.
  mkdir -p "$EOS_STATE_DIR"
  [ -s "$EOS_STATE_DIR/pg.password" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' > "$EOS_STATE_DIR/pg.password")
  EOS_PG_PASSWORD="$(cat "$EOS_STATE_DIR/pg.password")"
fi
# The SASL user's password: random per checkout, in a git-ignored mode-600 file.
: "${EOS_KAFKA_SASL_PASSWORD_FILE:=$EOS_STATE_DIR/kafka.sasl.password}"
if [ ! -s "$EOS_KAFKA_SASL_PASSWORD_FILE" ]; then
  mkdir -p "$(dirname "$EOS_KAFKA_SASL_PASSWORD_FILE")"
  (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' > "$EOS_KAFKA_SASL_PASSWORD_FILE")
fi
export EOS_ROOT EOS_STATE_DIR EOS_KAFKA_START_SECONDS EOS_KAFKA_SASL_PORT EOS_KAFKA_SASL_USER EOS_KAFKA_SASL_PASSWORD_FILE EOS_BIND_HOST EOS_KAFKA_PORT EOS_KAFKA_CONTROLLER_PORT \
  EOS_KAFKA_TXN_MAX_TIMEOUT_MS EOS_KAFKA_TXN_ABORT_INTERVAL_MS EOS_PG_PORT EOS_PG_DB EOS_PG_USER \
  EOS_PG_MAX_PREPARED EOS_KAFKA_LIBS EOS_SPARK_JARS_DIR EOS_VENV EOS_PG_PASSWORD EOS_SPARK_MASTER_PORT \
  EOS_SPARK_MASTER_UI_PORT EOS_SPARK_WORKER_PORT EOS_SPARK_WORKER_UI_PORT EOS_SPARK_WORKER_CORES EOS_SPARK_WORKER_MEMORY \
  EOS_SPARK_DEFAULT_CORES EOS_CONNECT_PORT EOS_CONNECT_LIBS EOS_CONNECT_PLUGIN_PATH EOS_SOURCE_PG_DB \
  EOS_SOURCE_PG_USER EOS_SOURCE_PUBLICATION EOS_SOURCE_PG_PASSWORD_FILE
