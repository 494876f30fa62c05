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
bash scripts/airflow.sh init || exit 1
"$venv/bin/ruff" check || exit 1
"$venv/bin/mypy" ${MYPY_PATHS:-airflow_provider_eos spark_apps demo dags bench} || exit 1
wait_for_cds
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words by design
timeout --signal=TERM --kill-after=60 "${TEST_WALL_TIMEOUT:-4800}" \
  "$venv/bin/pytest" tests -n "${PYTEST_WORKERS:-2}" --timeout="${PYTEST_TIMEOUT:-900}" ${PYTEST_ARGS:-}
