# The change-data-capture source side of the local stack, sourced by scripts/stack.sh (which
# defines log, die, pid_alive, port_open, require_free_port, wait_for, stop_pid_file, pg_bin):
#   - the source database on the stack's PostgreSQL, a role Debezium logs in as, and the
#     publication its pgoutput plugin reads (ensure_cdc_source, at every `start`);
#   - a Kafka Connect worker in distributed mode with exactly-once source support (KIP-618),
#     on loopback (start_connect / stop_connect).
# shellcheck shell=bash

connect_dir="$EOS_STATE_DIR/connect"
connect_pid="$connect_dir/connect.pid"
# The source role's password as Connect reads it: a FileConfigProvider resolves
# ${file:<this file>:password} inside the worker, so the password is never in a connector's
# config, in Connect's config topic, or in its REST answers.
connect_secrets_dir="$connect_dir/secrets"
connect_source_secrets="$connect_secrets_dir/source-db.properties"
# The target database's password, for a sink connector (the benchmark's JDBC sink peer).
connect_target_secrets="$connect_secrets_dir/target-db.properties"
connect_url() { echo "http://$EOS_BIND_HOST:$EOS_CONNECT_PORT"; }

psql_super() {  # $1 database, $2... psql options; SQL on stdin, as the cluster's superuser
  PGPASSWORD="$EOS_PG_PASSWORD" "$(pg_bin)/psql" -X -q -v ON_ERROR_STOP=1 -h "$EOS_BIND_HOST" \
    -p "$EOS_PG_PORT" -U "$EOS_PG_USER" -d "$1" "${@:2}"
}

# The SCRAM-SHA-256 verifier of the password in file $1, as PostgreSQL stores it (RFC 5803:
# iterations, salt, StoredKey, ServerKey). ALTER ROLE ... PASSWORD takes a verifier as it is, so
# the password itself never reaches the server, whose log would show the statement whenever
# statement logging is on.
scram_verifier() {
  "$EOS_VENV/bin/python" - "$1" <<'PY'
import base64, hashlib, hmac, os, sys

password = open(sys.argv[1], encoding="utf-8").read().rstrip("\n").encode()
salt, iterations = os.urandom(16), 4096
salted = hashlib.pbkdf2_hmac("sha256", password, salt, iterations)
stored = hashlib.sha256(hmac.new(salted, b"Client Key", "sha256").digest()).digest()
server = hmac.new(salted, b"Server Key", "sha256").digest()
b64 = lambda raw: base64.b64encode(raw).decode()
print(f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored)}:{b64(server)}")
PY
}

ensure_cdc_source() {
  local wal_level
  wal_level=$(psql_super postgres -tA <<< "SHOW wal_level")
  if [ "$wal_level" != logical ]; then
    log "WARNING: postgres runs with wal_level=$wal_level (a server started before CDC support);" \
      "change data capture needs logical: restart it with scripts/stack.sh stop-postgres, then start"
  fi
  local exists
  exists=$(psql_super postgres -tA <<< "SELECT 1 FROM pg_database WHERE datname = '$EOS_SOURCE_PG_DB'")
  [ "$exists" = 1 ] || PGPASSWORD="$EOS_PG_PASSWORD" "$(pg_bin)/createdb" -h "$EOS_BIND_HOST" \
    -p "$EOS_PG_PORT" -U "$EOS_PG_USER" "$EOS_SOURCE_PG_DB"
  # Only the password's SCRAM verifier travels, on psql's stdin, never on a command line. The
  # role may replicate and read the source's tables (Debezium's initial snapshot), those the
  # cluster's superuser makes later too, and nothing else: not pg_read_all_data, which reads the
  # catalogs' secrets too (pg_authid's password hashes), and which an older setup granted.
  local verifier
  verifier=$(scram_verifier "$EOS_SOURCE_PG_PASSWORD_FILE") || die "could not hash the CDC source role's password"
  psql_super "$EOS_SOURCE_PG_DB" <<SQL || die "could not set up the CDC source role $EOS_SOURCE_PG_USER"
SET client_min_messages = warning;
\\set role '$EOS_SOURCE_PG_USER'
\\set publication '$EOS_SOURCE_PUBLICATION'
\\set password '$verifier'
SELECT format('CREATE ROLE %I', :'role') WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') \\gexec
SELECT format('ALTER ROLE %I WITH LOGIN REPLICATION PASSWORD %L', :'role', :'password') \\gexec
SELECT format('REVOKE pg_read_all_data FROM %I', :'role') FROM pg_auth_members m
  WHERE m.roleid = 'pg_read_all_data'::regrole AND m.member = :'role'::regrole \\gexec
SELECT format('GRANT USAGE ON SCHEMA %I TO %I', nspname, :'role'),
       format('GRANT SELECT ON ALL TABLES IN SCHEMA %I TO %I', nspname, :'role')
  FROM pg_namespace WHERE nspname <> 'information_schema' AND nspname !~ '^pg_' \\gexec
SELECT format('ALTER DEFAULT PRIVILEGES FOR ROLE %I GRANT USAGE ON SCHEMAS TO %I', current_user, :'role'),
       format('ALTER DEFAULT PRIVILEGES FOR ROLE %I GRANT SELECT ON TABLES TO %I', current_user, :'role') \\gexec
-- FOR ALL TABLES needs a superuser, so the publication is made here rather than by Debezium
-- (its publication.autocreate.mode is disabled in the connectors this project creates).
SELECT format('CREATE PUBLICATION %I FOR ALL TABLES', :'publication')
  WHERE NOT EXISTS (SELECT FROM pg_publication WHERE pubname = :'publication') \\gexec
SQL
  mkdir -p "$connect_secrets_dir"
  (umask 077; printf 'password=%s\n' "$(cat "$EOS_SOURCE_PG_PASSWORD_FILE")" > "$connect_source_secrets"
   printf 'password=%s\n' "$EOS_PG_PASSWORD" > "$connect_target_secrets")
  log "CDC source: database $EOS_SOURCE_PG_DB, role $EOS_SOURCE_PG_USER, publication $EOS_SOURCE_PUBLICATION"
}

write_connect_config() {
  mkdir -p "$connect_dir"
  cat > "$connect_dir/worker.properties" <<EOF
# Generated by scripts/stack.sh: one Kafka Connect worker in distributed mode on loopback.
bootstrap.servers=$EOS_BIND_HOST:$EOS_KAFKA_PORT
group.id=eos-connect
listeners=http://$EOS_BIND_HOST:$EOS_CONNECT_PORT
rest.advertised.host.name=$EOS_BIND_HOST
rest.advertised.port=$EOS_CONNECT_PORT
plugin.path=$EOS_CONNECT_PLUGIN_PATH
# Every plugin here has ServiceLoader manifests: finding them so takes ~2 s, where scanning
# every class (the default hybrid_warn) takes ~30 s on 2 cores.
plugin.discovery=service_load
# KIP-618: source tasks write records and their offsets in one Kafka transaction, so a connector
# that sets exactly.once.support=required delivers each change once to read_committed readers.
exactly.once.source.support=enabled
key.converter=org.apache.kafka.connect.json.JsonConverter
value.converter=org.apache.kafka.connect.json.JsonConverter
key.converter.schemas.enable=true
value.converter.schemas.enable=true
config.storage.topic=eos-connect-configs
offset.storage.topic=eos-connect-offsets
status.storage.topic=eos-connect-status
# One broker: the internal topics cannot have the default replication of 3.
config.storage.replication.factor=1
offset.storage.replication.factor=1
offset.storage.partitions=5
status.storage.replication.factor=1
status.storage.partitions=1
# A worker that restarts rejoins as a new member: without this its former tasks would wait out
# the default 5-minute delay before they are assigned again.
scheduled.rebalance.max.delay.ms=0
config.providers=file
config.providers.file.class=org.apache.kafka.common.config.provider.FileConfigProvider
config.providers.file.param.allowed.paths=$connect_secrets_dir
EOF
  cat > "$connect_dir/log4j2.properties" <<EOF
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
logger.connect.name = org.apache.kafka.connect.runtime
logger.connect.level = INFO
logger.debezium.name = io.debezium
logger.debezium.level = INFO
EOF
}

connect_ready() {
  pid_alive "$connect_pid" || die "kafka connect exited during start: see $connect_dir/connect.log"
  # The REST port opens (answering 404) before its resources are registered, and before the
  # worker has joined its group and read the internal topics: ready is when both are done.
  port_open "$EOS_CONNECT_PORT" && grep -q "Finished starting connectors and tasks" "$connect_dir/connect.log" \
    && grep -q "REST resources initialized" "$connect_dir/connect.log"
}

start_connect() {
  # One start at a time (the demo starts the worker in the background while a test's fixture may
  # ask for it too): a second caller waits for the first's worker to answer, never returns before.
  mkdir -p "$connect_dir"
  exec 8> "$connect_dir/start.lock"
  flock 8
  if pid_alive "$connect_pid"; then
    wait_for 120 "kafka connect on $(connect_url)" connect_ready \
      || die "kafka connect (pid $(cat "$connect_pid")) did not answer within 120s: see $connect_dir/connect.log"
    exec 8>&-
    return
  fi
  ls "$EOS_CONNECT_LIBS"/connect-runtime-*.jar >/dev/null 2>&1 \
    || die "Kafka Connect's jars are missing in $EOS_CONNECT_LIBS: run scripts/install.sh (it fetches them with Maven)"
  ls "$EOS_CONNECT_PLUGIN_PATH"/debezium-postgres/debezium-connector-postgres-*.jar >/dev/null 2>&1 \
    || die "Debezium's jars are missing in $EOS_CONNECT_PLUGIN_PATH/debezium-postgres: run scripts/install.sh"
  [ -f "$EOS_CONNECT_PLUGIN_PATH/eos-connect/eos-connect.jar" ] \
    || die "the project's Connect plugin is missing in $EOS_CONNECT_PLUGIN_PATH/eos-connect: run scripts/install.sh"
  port_open "$EOS_KAFKA_PORT" || die "kafka is not running on $EOS_BIND_HOST:$EOS_KAFKA_PORT: run scripts/stack.sh start first"
  require_free_port "$EOS_CONNECT_PORT" "kafka connect" EOS_CONNECT_PORT
  write_connect_config
  : > "$connect_dir/connect.log"
  # setsid: the worker must outlive the shell that started it (make, a test's fixture). It must not
  # keep the start lock's descriptor (8>&-), or the lock would be held as long as the worker runs.
  setsid bash -c 'exec java -Xms128m -Xmx768m -Dlog4j2.configurationFile="$1" -cp "$2/*" \
      org.apache.kafka.connect.cli.ConnectDistributed "$3"' \
    _ "$connect_dir/log4j2.properties" "$EOS_CONNECT_LIBS" "$connect_dir/worker.properties" \
    > "$connect_dir/connect.log" 2>&1 < /dev/null 8>&- &
  echo $! > "$connect_pid"
  wait_for 120 "kafka connect on $(connect_url)" connect_ready \
    || die "kafka connect did not start within 120s: see $connect_dir/connect.log"
  exec 8>&-
}

stop_connect() { stop_pid_file "$connect_pid" "kafka connect"; }

connect_status() {
  if pid_alive "$connect_pid"; then echo "connect: running ($(connect_url))"; else echo "connect: stopped"; fi
}

write_connect_env() {  # appended to stack.env: what a client of the CDC source needs
  cat >> "$EOS_STATE_DIR/stack.env" <<EOF
# Kafka Connect's REST API (running only after start-connect) and the CDC source database;
# a connector names its password as \${file:\$EOS_CONNECT_SOURCE_SECRETS:password} (the source's)
# or \${file:\$EOS_CONNECT_TARGET_SECRETS:password} (the target's).
export EOS_CONNECT_URL=$(connect_url)
export EOS_SOURCE_PG_DB=$EOS_SOURCE_PG_DB
export EOS_SOURCE_PG_USER=$EOS_SOURCE_PG_USER
export EOS_SOURCE_PUBLICATION=$EOS_SOURCE_PUBLICATION
export EOS_SOURCE_PG_PASSWORD_FILE=$EOS_SOURCE_PG_PASSWORD_FILE
export EOS_CONNECT_SOURCE_SECRETS=$connect_source_secrets
export EOS_CONNECT_TARGET_SECRETS=$connect_target_secrets
EOF
}
