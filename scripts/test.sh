#!/usr/bin/env bash
# `make test`: start the local stack if it is not running, lint, run pytest (the tests that kill
# a daemon on a second stack of their own, beside the others),
# then stop what this run started (and only that: a stack that was already up,
# e.g. a developer's, stays up). Exits with pytest's (or lint's) status.
#
#   PYTEST_TIMEOUT=900 TEST_WALL_TIMEOUT=4800 PYTEST_ARGS='-k fencing' scripts/test.sh
#   PYTEST_WORKERS=0 scripts/test.sh    one process instead of two xdist workers
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/.."
venv="${EOS_VENV:-.venv}"

status=$(bash scripts/stack.sh status)
started_stack=0
if grep -qE '^(kafka|postgres): stopped' <<< "$status"; then
  started_stack=1
fi
# The Spark standalone cluster is started by the tests that need it (tests/conftest.py), which
# stop it again; this catches a pytest killed by the wall timeout.
spark_was_running=0
if grep -q '^spark: running' <<< "$status"; then
  spark_was_running=1
fi
# Likewise the Kafka Connect worker, started by the change-data-capture tests.
connect_was_running=0
if grep -q '^connect: running' <<< "$status"; then
  connect_was_running=1
fi
stop_started() {
  if [ "$spark_was_running" -eq 0 ]; then
    bash scripts/stack.sh stop-spark > /dev/null || true
  fi
  if [ "$connect_was_running" -eq 0 ]; then
    bash scripts/stack.sh stop-connect > /dev/null || true
  fi
  if [ "$started_stack" -eq 1 ]; then
    echo "test: stopping the stack this run started"
    bash scripts/stack.sh stop || true
  fi
}
trap stop_started EXIT

bash scripts/stack.sh start || exit 1
# The tests' Spark drivers map Spark's classes from an archive that one app run dumps once per
# machine (tests/helpers/spark_cds.py, about a minute): dumped here, beside airflow init, ruff and
# mypy, so the first test does not wait for it. Without it the tests run, only slower.
mkdir -p .local
"$venv/bin/python" -m tests.helpers.spark_cds > .local/spark-cds.log 2>&1 &
cds_pid=$!
wait_for_cds() {
  if [ -n "${cds_pid:-}" ]; then
    wait "$cds_pid" || echo "test: no Spark class archive (.local/spark-cds.log); the tests run without it"
    cds_pid=""
  fi
}
trap 'wait_for_cds; stop_started' EXIT
# The tests' own Airflow deployment for their dag.test() runs (tests/helpers/airflow_tests_env.py),
# migrated beside the demo's.
"$venv/bin/python" -m tests.helpers.airflow_tests_env > .local/airflow-tests-init.log 2>&1 &
tests_airflow_pid=$!
bash scripts/airflow.sh init || exit 1
wait "$tests_airflow_pid" || { cat .local/airflow-tests-init.log; exit 1; }
"$venv/bin/ruff" check || exit 1
"$venv/bin/mypy" ${MYPY_PATHS:-airflow_provider_eos spark_apps demo dags bench} || exit 1
wait_for_cds
# Two phases at once: everything else on the xdist workers, and beside them, in one process, the
# tests that kill or restart a daemon (the broker, PostgreSQL, the Connect worker: marker
# stack_faults). Those get a stack of their own: another state directory and ports (100 above the
# shared stack's), the same installed Kafka, Connect plugins and Spark jars, and the tests' Spark
# class archive. So no other test sees their faults, and their broker's restart recovers only their
# own partitions. Both share the wall timeout; the exit is the first phase's failure, else the
# second's ("no tests" in one phase is no failure once the other ran some).
state="${EOS_STATE_DIR:-$PWD/.local}"
faults_state="$state/stack-faults"
faults_env=(
  EOS_STATE_DIR="$faults_state"
  EOS_KAFKA_PORT=$(( ${EOS_KAFKA_PORT:-19092} + 100 ))
  EOS_KAFKA_CONTROLLER_PORT=$(( ${EOS_KAFKA_CONTROLLER_PORT:-19093} + 100 ))
  EOS_KAFKA_SASL_PORT=$(( ${EOS_KAFKA_SASL_PORT:-19094} + 100 ))
  EOS_PG_PORT=$(( ${EOS_PG_PORT:-15432} + 100 ))
  EOS_CONNECT_PORT=$(( ${EOS_CONNECT_PORT:-18083} + 100 ))
  EOS_SPARK_MASTER_PORT=$(( ${EOS_SPARK_MASTER_PORT:-17077} + 100 ))
  EOS_SPARK_MASTER_UI_PORT=$(( ${EOS_SPARK_MASTER_UI_PORT:-18091} + 100 ))
  EOS_SPARK_WORKER_PORT=$(( ${EOS_SPARK_WORKER_PORT:-17078} + 100 ))
  EOS_SPARK_WORKER_UI_PORT=$(( ${EOS_SPARK_WORKER_UI_PORT:-18092} + 100 ))
  EOS_AIRFLOW_API_PORT=$(( ${EOS_AIRFLOW_API_PORT:-18080} + 100 ))
  EOS_KAFKA_LIBS="${EOS_KAFKA_LIBS:-$state/kafka-libs}"
  EOS_CONNECT_LIBS="${EOS_CONNECT_LIBS:-$state/connect-libs}"
  EOS_CONNECT_PLUGIN_PATH="${EOS_CONNECT_PLUGIN_PATH:-$state/connect-plugins}"
  EOS_SPARK_JARS_DIR="${EOS_SPARK_JARS_DIR:-$state/spark-jars}"
)
mkdir -p "$faults_state"
for shared in spark-cds spark-cds.lock test-durations.tsv; do  # one class archive, one durations file
  ln -sfn "$state/$shared" "$faults_state/$shared"
done
stop_faults_stack() {
  env "${faults_env[@]}" bash scripts/stack.sh stop-connect > /dev/null 2>&1 || true
  env "${faults_env[@]}" bash scripts/stack.sh stop > /dev/null 2>&1 || true
}
trap 'wait_for_cds; stop_faults_stack; stop_started' EXIT
started=$(date +%s)
wall=${TEST_WALL_TIMEOUT:-4800}
faults_log="$state/test-stack-faults.log"
# -rP: these tests print the oracle's counts of each fault run (rows that differ, changes applied),
# which the log keeps even when they pass. Their output is shown once the first phase ends.
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words by design
env "${faults_env[@]}" timeout --signal=TERM --kill-after=60 "$wall" \
  "$venv/bin/pytest" tests -p no:xdist --timeout="${PYTEST_TIMEOUT:-900}" -m stack_faults -rP ${PYTEST_ARGS:-} \
  > "$faults_log" 2>&1 &
faults_pid=$!
# shellcheck disable=SC2086
timeout --signal=TERM --kill-after=60 "$wall" \
  "$venv/bin/pytest" tests -n "${PYTEST_WORKERS:-2}" --timeout="${PYTEST_TIMEOUT:-900}" -m "not stack_faults" \
  ${PYTEST_ARGS:-}
parallel_status=$?
wait "$faults_pid"
alone_status=$?
echo "test: the stack-fault tests, on a stack of their own (log: $faults_log):"
cat "$faults_log"
echo "test: both phases ended after $(( $(date +%s) - started ))s"
if [ "$parallel_status" -ne 0 ] && [ "$parallel_status" -ne 5 ]; then
  exit "$parallel_status"
fi
if [ "$alone_status" -eq 5 ] && [ "$parallel_status" -eq 0 ]; then
  exit 0
fi
if [ "$alone_status" -eq 0 ] && [ "$parallel_status" -eq 5 ]; then
  exit 0
fi
exit "$alone_status"
