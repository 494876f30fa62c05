#!/usr/bin/env bash
# `make test`: start the local stack if it is not running, lint, run pytest,
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
# Two phases: everything else on the xdist workers, then the tests that kill or restart a daemon
# the other workers' tests share (the broker, PostgreSQL, the Connect worker: marker stack_faults),
# alone in one process. Both share the wall timeout; the exit is the first phase's failure, else
# the second's ("no tests" there is no failure once the first phase ran some).
started=$(date +%s)
wall=${TEST_WALL_TIMEOUT:-4800}
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words by design
timeout --signal=TERM --kill-after=60 "$wall" \
  "$venv/bin/pytest" tests -n "${PYTEST_WORKERS:-2}" --timeout="${PYTEST_TIMEOUT:-900}" -m "not stack_faults" \
  ${PYTEST_ARGS:-}
parallel_status=$?
left=$(( wall - ($(date +%s) - started) ))
if [ "$parallel_status" -ne 0 ] && [ "$parallel_status" -ne 5 ] || [ "$left" -le 60 ]; then
  exit "$parallel_status"
fi
# A stack this run started holds only its tests' leftovers: their topics, which a SIGKILLed
# broker recovers one by one before it listens again (tests/helpers/stack_reset.py).
if [ "$started_stack" -eq 1 ]; then
  "$venv/bin/python" -m tests.helpers.stack_reset || echo "test: the stack's leftovers stay (see above)"
fi
# -rP: these tests print the oracle's counts of each fault run (rows that differ, changes applied),
# which the log keeps even when they pass.
# shellcheck disable=SC2086
timeout --signal=TERM --kill-after=60 "$left" \
  "$venv/bin/pytest" tests -p no:xdist --timeout="${PYTEST_TIMEOUT:-900}" -m stack_faults -rP ${PYTEST_ARGS:-}
alone_status=$?
if [ "$alone_status" -eq 5 ] && [ "$parallel_status" -eq 0 ]; then
  exit 0
fi
if [ "$alone_status" -eq 0 ] && [ "$parallel_status" -eq 5 ]; then
  exit 0
fi
exit "$alone_status"
