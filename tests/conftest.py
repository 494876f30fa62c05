"""Session fixtures: the real local stack (Kafka, PostgreSQL, Spark jars), started
once by scripts/stack.sh or reused when it already runs."""

from __future__ import annotations

import logging
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg2 import sql as psycopg2_sql

from demo.env_files import STATE_DIR, read_env_file
from tests.helpers.cdc_source import Source, source_connection
from tests.helpers.locks import file_lock
from tests.helpers.spark_cds import TEST_SPARK_SUBMIT_OPTS, driver_archive_opts

ROOT = Path(__file__).resolve().parents[1]
# py4j logs "Closing down clientserver connection" at INFO from a __del__ at interpreter exit (a
# test's in-process SparkSession), after the xdist worker's output stream has closed: every run's
# output ended in a "--- Logging error ---" traceback that was no error of the tests.
logging.getLogger("py4j").setLevel(logging.WARNING)


# Modules that share the demo's Airflow deployment, so they run one after another on one xdist
# worker: the demo's api-server, scheduler and triggerer on fixed ports, the airflow.env that
# `airflow.sh env` rewrites, and the Spark standalone cluster (3 cores: the demo's two streams and
# replay fill it, so a second user on another worker would wait for executors).
DEMO_DEPLOYMENT_MODULES = frozenset({
    "test_demo.py", "test_stack_airflow.py", "test_spark_cluster.py", "test_external_spec.py",
})
DEMO_DEPLOYMENT_UNIT = "demo-deployment"
# Modules whose DAG runs (dag.test()) share the tests' own Airflow deployment
# (tests/helpers/airflow_tests_env.py: its metadata database, definition folder and lineage file):
# one after another on another worker, beside the demo.
DAG_TEST_MODULES = frozenset({
    "test_dags.py", "test_recovery_dag.py", "test_recovery_params.py", "test_metrics.py", "test_sasl_kafka.py",
    "test_howto_own_spec.py", "test_cdc_airflow.py",
})
DAG_TEST_UNIT = "dag-tests"
# Modules that use the Kafka Connect worker (the ``connect`` fixture) and may restart it: they run
# on one worker, one after another.
CONNECT_MODULES = frozenset({"test_cdc_source.py", "test_cdc_mirror.py"})
CONNECT_UNIT = "kafka-connect"
# Every other module is a unit of its own, so that its module fixtures are set up once; Kafka and
# PostgreSQL serve every worker (tests use unique names).
_SHARED_UNITS = {**dict.fromkeys(DEMO_DEPLOYMENT_MODULES, DEMO_DEPLOYMENT_UNIT),
                 **dict.fromkeys(DAG_TEST_MODULES, DAG_TEST_UNIT), **dict.fromkeys(CONNECT_MODULES, CONNECT_UNIT)}


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to on the xdist workers: its module, or a shared one."""
    module = nodeid.split("::", 1)[0]
    return _SHARED_UNITS.get(Path(module).name, module)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without the plugin
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Deals out ``work_unit``s, in collection order, so the demo (collected first) starts at once
    on one worker while the others take the dag.test() unit and the modules.
    (xdist's own ``loadgroup`` cannot be used: its group marker does not reach pytest 9's ids.)"""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return WorkUnits(config, log)


# Every test's phases with their times, one line each, appended by every worker: where a run's
# time went beyond the 30 slowest that pytest prints (`sort -t$'\t' -k4 -rn` it, or sum by module).
DURATIONS_FILE = STATE_DIR / "test-durations.tsv"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if getattr(report, "node", None) is not None:
        return  # xdist's controller, handed a worker's report: the worker wrote its line
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    DURATIONS_FILE.parent.mkdir(parents=True, exist_ok=True)
    with DURATIONS_FILE.open("a") as out:
        out.write(f"{int(time.time())}\t{worker}\t{report.when}\t{report.duration:.2f}\t{report.outcome}\t"
                  f"{report.nodeid}\n")


@pytest.fixture(autouse=True)
def _no_app_outlives_its_test() -> Iterator[None]:
    """Ends (SIGKILL, by process group) every app run the test started and left running: a test that
    fails before its own kill or wait would otherwise leave a driver spending CPU under the next
    tests. A run marked ``outlives_test`` (a module fixture's driver) is its fixture's to end."""
    from bench.harness import STARTED_RUNS

    before = len(STARTED_RUNS)
    yield
    for run in STARTED_RUNS[before:]:
        if run.process.poll() is None and not run.outlives_test:
            run.kill()
    del STARTED_RUNS[before:]


def spark_submit_opts() -> str:
    """SPARK_SUBMIT_OPTS for the tests' spark-submits: the environment's, else the tests' own."""
    return os.environ.get("SPARK_SUBMIT_OPTS", TEST_SPARK_SUBMIT_OPTS)


@pytest.fixture(scope="session")
def stack() -> dict[str, str]:
    """Starts (or reuses) the local stack and exports its settings to os.environ."""
    with file_lock(STATE_DIR / "stack.lock"):  # each xdist worker asks; one starts it, the other finds it running
        subprocess.run([str(ROOT / "scripts" / "stack.sh"), "start"], check=True)
    env = read_env_file(STATE_DIR / "stack.env")
    os.environ.update(env)
    # The deployment's [eos] spark_jars, as scripts/airflow.sh sets it for the Airflow components:
    # the operators the tests run in this process spark-submit with the Kafka connector from it.
    os.environ.setdefault("AIRFLOW__EOS__SPARK_JARS", env["EOS_SPARK_JARS"])
    opts = spark_submit_opts()
    if "SPARK_SUBMIT_OPTS" not in os.environ:  # the tests' own options: add their class archive
        opts = f"{opts} {driver_archive_opts(env, STATE_DIR, opts)}".strip()
    os.environ["SPARK_SUBMIT_OPTS"] = opts  # spark-submits started from here inherit it
    return env


@pytest.fixture
def unique_name() -> str:
    """A fresh suffix so tests never share topics, pipelines or tables."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def kafka_bootstrap(stack: dict[str, str]) -> str:
    return stack["EOS_KAFKA_BOOTSTRAP"]


@pytest.fixture
def pg_dsn(stack: dict[str, str]) -> str:
    """A libpq DSN without the password; libpq reads PGPASSWORD from the environment."""
    os.environ["PGPASSWORD"] = stack["EOS_PG_PASSWORD"]
    return (
        f"host={stack['EOS_PG_HOST']} port={stack['EOS_PG_PORT']} "
        f"dbname={stack['EOS_PG_DB']} user={stack['EOS_PG_USER']}"
    )


@pytest.fixture
def pg_conn(pg_dsn: str) -> Iterator:
    import psycopg2

    conn = psycopg2.connect(pg_dsn)
    conn.autocommit = True
    yield conn
    conn.close()


@pytest.fixture
def meta(pg_conn: Any, unique_name: str) -> Iterator[str]:
    """A fresh meta schema with every meta table (``state/meta_tables``), dropped afterwards."""
    from psycopg2 import sql

    from spark_apps.eos_stream.state import meta_tables

    schema = f"m_{unique_name}"
    with pg_conn.cursor() as cur:
        for statement in meta_tables.ddl_statements(schema):
            cur.execute(statement)
    yield schema
    with pg_conn.cursor() as cur:
        cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture(scope="session")
def spark_cluster(stack: dict[str, str]) -> Iterator[str]:
    """A Spark standalone cluster (scripts/stack.sh start-spark): its master URL. Stopped at the end
    of the session only if this session started it."""
    script = str(ROOT / "scripts" / "stack.sh")
    running = "spark: running" in subprocess.run(["bash", script, "status"], capture_output=True, text=True,
                                                  check=True, timeout=60).stdout
    if not running:
        subprocess.run(["bash", script, "start-spark"], check=True, timeout=180)
    try:
        yield stack["EOS_SPARK_MASTER_URL"]
    finally:
        if not running:
            subprocess.run(["bash", script, "stop-spark"], check=False, timeout=120)


@pytest.fixture(scope="session")
def connect(stack: dict[str, str]) -> Iterator[dict[str, str]]:
    """The stack's Kafka Connect worker (scripts/stack.sh start-connect), started unless it already
    runs. Session-scoped: starting it costs most of a minute. A lone session stops what it started
    at its end; under xdist the other worker's session may still use it, so scripts/test.sh stops
    it after both (it knows whether it ran before)."""
    script = str(ROOT / "scripts" / "stack.sh")
    with file_lock(STATE_DIR / "connect.lock"):
        status = subprocess.run(["bash", script, "status"], capture_output=True, text=True, check=True, timeout=60)
        running = "connect: running" in status.stdout
        if not running:
            started = time.monotonic()
            subprocess.run(["bash", script, "start-connect"], check=True, timeout=180)
            print(f"kafka connect started in {time.monotonic() - started:.1f}s")
    try:
        yield stack
    finally:
        if not running and "PYTEST_XDIST_WORKER" not in os.environ:
            subprocess.run(["bash", script, "stop-connect"], check=False, timeout=120)


@pytest.fixture
def source(connect: dict[str, str], unique_name: str) -> Iterator[Source]:
    """The CDC source database with a fresh schema (dropped at the end)."""
    conn = source_connection(connect)
    schema = f"cdc_{unique_name}"
    with conn.cursor() as cur:
        cur.execute(psycopg2_sql.SQL("CREATE SCHEMA {}").format(psycopg2_sql.Identifier(schema)))
    yield Source(conn, schema)
    with conn.cursor() as cur:
        cur.execute(psycopg2_sql.SQL("DROP SCHEMA {} CASCADE").format(psycopg2_sql.Identifier(schema)))
    conn.close()
