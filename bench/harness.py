"""The local stack's harness, for the benchmarks and the tests: where the stack's settings are, a
pipeline's app config on it, and the app (under spark-submit), the continuous engine, the Spark-less
replay and the audit run as real child processes. It imports nothing of the tests or the demo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg2
from psycopg2 import sql

from airflow_provider_eos.launchers.spark_options import LOCAL_DRIVER_JAVA_OPTIONS, is_local_master

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "spark_apps" / "eos_stream" / "app.py"
SPARK_SUBMIT = Path(sys.executable).with_name("spark-submit")
# Where scripts/stack.sh and scripts/airflow.sh keep their state and write their env files
# (scripts/config.sh: $EOS_STATE_DIR, default .local in the checkout).
STATE_DIR = Path(os.environ.get("EOS_STATE_DIR", ROOT / ".local"))
T = TypeVar("T")
# A benchmark's own choice of the app driver's JVM options on a local master, instead of the
# stream operator's (an empty value: the JVM's defaults), to compare them.
DRIVER_JAVA_OPTIONS_ENV = "EOS_BENCH_DRIVER_JAVA_OPTIONS"


def read_env_file(path: Path) -> dict[str, str]:
    """An env file the stack's scripts write (``export KEY=value`` lines) as a dict."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export "):].partition("=")
            env[key] = value.strip("'\"")
    return env


def pipeline_config(stack: dict[str, str], tmp_path: Path, name: str, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "pipeline": name,
        "topics": [f"ledger.{name}"],
        "kafka_bootstrap": stack["EOS_KAFKA_BOOTSTRAP"],
        "spec": "spark_apps.ledger.spec:LEDGER",
        "delivery": "exactly_once",
        "trigger": "availableNow",
        "max_offsets_per_trigger": 5000,
        "checkpoint_dir": str(tmp_path / "checkpoints"),
        "target_schema": f"t_{name}",
        "meta_schema": f"m_{name}",
        "create_targets": True,
        "postgres": {"host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
                     "dbname": stack["EOS_PG_DB"], "user": stack["EOS_PG_USER"]},
    }
    config.update(overrides)
    return config


# Every app run started here and not yet waited for: a test's teardown (tests/conftest.py) ends
# those its test left running, so a failed test's driver does not spend the rest of a run's CPU.
STARTED_RUNS: list[AppRun] = []


@dataclass
class AppRun:
    process: subprocess.Popen
    log_path: Path
    started: float = field(default_factory=time.monotonic)
    # A run a module's fixture keeps across its tests: no test's teardown ends it.
    outlives_test: bool = False

    def __post_init__(self) -> None:
        STARTED_RUNS.append(self)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the whole driver: spark-submit's JVM and the Python app."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, kind: str) -> list[dict[str, Any]]:
        prefix = f"EOS-{kind.upper()} "
        decoder = json.JSONDecoder()  # raw_decode: a JVM line may follow on the same line
        return [decoder.raw_decode(line[len(prefix):])[0] for line in self.log().splitlines()
                if line.startswith(prefix)]


def spark_submit(master: str, jars: str, conf: dict[str, str] | None = None) -> list[str]:
    """spark-submit with the settings every app run here has (a benchmark's Spark peer too),
    then ``conf``'s properties."""
    more = [arg for key, value in (conf or {}).items() for arg in ("--conf", f"{key}={value}")]
    return [str(SPARK_SUBMIT), "--master", master, "--jars", jars,
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.ui.showConsoleProgress=false",
            "--conf", "spark.driver.host=127.0.0.1",
            "--conf", "spark.driver.bindAddress=127.0.0.1",
            "--conf", "spark.sql.shuffle.partitions=2",
            "--driver-memory", "1g", *more]  # last: a property given twice takes its last value


def start_app(config: dict[str, Any], tmp_path: Path, env_extra: dict[str, str] | None = None,
              label: str = "run", root: Path = ROOT, master: str = "local[2]",
              spark_conf: dict[str, str] | None = None) -> AppRun:
    """Starts the app of the checkout at ``root`` (another one: a benchmark's baseline build),
    with ``spark_conf``'s Spark properties. A benchmark's Spark peers (``spark_submit``) keep the
    JVM's defaults, as a user's own Spark job would."""
    config_path = tmp_path / f"{config['pipeline']}.json"
    config_path.write_text(json.dumps(config))
    log_path = tmp_path / f"{label}-{time.monotonic_ns()}.log"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           **(env_extra or {})}
    # The driver JVM's options the stream operator gives a local master, or the benchmark's own.
    jvm = os.environ.get(DRIVER_JAVA_OPTIONS_ENV, LOCAL_DRIVER_JAVA_OPTIONS)
    if is_local_master(master) and jvm:
        spark_conf = {"spark.driver.defaultJavaOptions": jvm, **(spark_conf or {})}
    command = [*spark_submit(master, os.environ["EOS_SPARK_JARS"], spark_conf),
               str(root / APP.relative_to(ROOT)), "--config", str(config_path)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                   start_new_session=True)
    return AppRun(process, log_path)


def start_continuous(config: dict[str, Any], tmp_path: Path, env_extra: dict[str, str] | None = None,
                     label: str = "continuous", root: Path = ROOT) -> AppRun:
    """Starts the continuous engine (``spark_apps.eos_stream.engines.continuous``) of the checkout at
    ``root`` on ``config`` (its engine set to ``continuous``, with the only trigger it takes), in a
    process group of its own, as the provider's hook does; its output goes to the run's log."""
    config = {**config, "engine": "continuous", "trigger": "processingTime"}
    config_path = tmp_path / f"{config['pipeline']}-{label}.json"
    config_path.write_text(json.dumps(config))
    log_path = tmp_path / f"{label}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "spark_apps.eos_stream.engines.continuous", "--config",
                                    str(config_path)], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env_extra or {})}, cwd=root, start_new_session=True)
    return AppRun(process, log_path)


def run_app(config: dict[str, Any], tmp_path: Path, timeout: float = 300, **kwargs: Any) -> AppRun:
    run = start_app(config, tmp_path, **kwargs)
    try:
        run.wait(timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        raise AssertionError(f"app did not finish in {timeout}s; log tail:\n{run.log()[-4000:]}") from None
    return run


def run_direct_replay(config: dict[str, Any], tmp_path: Path, env_extra: dict[str, str] | None = None,
                      label: str = "replay", timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs the Spark-less replay (``spark_apps.eos_stream.engines.direct_replay``) of ``config`` to Kafka's
    last stable offsets: the app's claim and sink without a JVM, for a test that needs a pipeline's
    state but not Spark. In its own process group (a fault point kills the whole group).

    :param config: the app config (:func:`pipeline_config`).
    :param tmp_path: where its config file goes.
    :param env_extra: added to this process's environment.
    :param label: names the config file.
    :param timeout: seconds before ``subprocess.TimeoutExpired``.
    :return: the finished process, its stdout and stderr captured as text.
    """
    path = tmp_path / f"{config['pipeline']}-{label}.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, "-m", "spark_apps.eos_stream.engines.direct_replay", "--config", str(path)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env_extra or {})},
                          timeout=timeout, start_new_session=True)


def pg_connect(stack: dict[str, str]):
    conn = psycopg2.connect(host=stack["EOS_PG_HOST"], port=stack["EOS_PG_PORT"], dbname=stack["EOS_PG_DB"],
                            user=stack["EOS_PG_USER"], password=stack["EOS_PG_PASSWORD"])
    conn.autocommit = True
    return conn


def source_connection(stack: dict[str, str]) -> Any:
    """An autocommit connection to the change-data-capture source database, as the cluster's superuser."""
    conn = psycopg2.connect(host=stack["EOS_PG_HOST"], port=stack["EOS_PG_PORT"], user=stack["EOS_PG_USER"],
                            password=stack["EOS_PG_PASSWORD"], dbname=stack["EOS_SOURCE_PG_DB"])
    conn.autocommit = True
    return conn


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = 120.0, interval: float = 1.0) -> T:
    """``probe``'s first truthy result, polled every ``interval`` seconds for at most ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {result!r})")
        time.sleep(interval)


def drop_replication_slot(conn: Any, slot: str, timeout: float = 60.0) -> None:
    """Drops a connector's replication slot once its WAL sender has let go (``conn``: autocommit,
    on the slot's database): a slot left behind would hold the stack's WAL for ever."""
    def released() -> bool:
        with conn.cursor() as cur:
            cur.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,))
            row = cur.fetchone()
            if row is None:
                return True
            if row[0]:
                return False
            cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            return True
    wait_until(f"slot {slot} released", released, timeout=timeout)


def ledger_rows(stack: dict[str, str], schema: str) -> int:
    """Rows in ``<schema>.ledger_events`` (0 while the table does not exist yet)."""
    from psycopg2 import sql

    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s)", (sql.SQL("{}.ledger_events").format(
                sql.Identifier(schema)).as_string(cur),))
            if cur.fetchone() == (None,):
                return 0
            cur.execute(sql.SQL("SELECT count(*) FROM {}.ledger_events").format(sql.Identifier(schema)))
            row = cur.fetchone()
            return int(row[0]) if row else 0
    finally:
        conn.close()


def audit(config: dict[str, Any], tmp_path: Path, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    config_path = tmp_path / f"{config['pipeline']}-audit.json"
    config_path.write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "spark_apps.eos_stream.audit", "--config", str(config_path)],
                            capture_output=True, text=True, cwd=ROOT, timeout=600,
                            env={**os.environ, **(env_extra or {})})
    report = json.loads(result.stdout)
    report["exit_code"] = result.returncode
    return report


def topics_exist(bootstrap: str, topics: list[str]) -> bool:
    """Whether the broker lists every one of ``topics`` (a connector creates its topics with its first records)."""
    from confluent_kafka.admin import AdminClient

    listed = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
    return all(topic in listed for topic in topics)


def kafka_connect_connection(stack: dict[str, str]) -> str:
    """The Airflow connection (JSON, for an ``AIRFLOW_CONN_*`` variable) to the stack's Kafka
    Connect worker, as ``KafkaConnectHook`` reads it."""
    host, port = stack["EOS_CONNECT_URL"].removeprefix("http://").split(":")
    return json.dumps({"conn_type": "kafka_connect", "host": host, "port": int(port), "schema": "http"})


def drop_source_schema(stack: dict[str, str], slot: str, schema: str) -> None:
    """Drops a connector's replication slot once let go (``drop_replication_slot``), then its
    source schema."""
    conn = source_connection(stack)
    try:
        drop_replication_slot(conn, slot)
        with conn.cursor() as cur:
            cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    finally:
        conn.close()


def drop_cdc_source(stack: dict[str, str], hook: Any, connector: str, slot: str, schema: str) -> None:
    """Deletes a benchmark's source connector (``hook``: a KafkaConnectHook), then its replication
    slot and its source schema."""
    hook.delete_connector(connector)
    drop_source_schema(stack, slot, schema)


def _process_role(pid: int) -> str | None:
    """What an app's process is: its JVM, the Python driver, or a Python worker of Spark's."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    text = b" ".join(command).decode(errors="replace")
    if "java" in Path(command[0].decode(errors="replace")).name:
        return "jvm"
    if "pyspark.daemon" in text or "pyspark.worker" in text:
        return "python_workers"
    if "app.py" in text or "eos_stream.engines" in text:
        return "python_driver"
    return None


def group_rss_mib(group: int) -> dict[str, float]:
    """Resident memory (RSS, MiB) of one process group's processes (an ``AppRun``'s: its process
    is the group's leader), summed per role (``_process_role``)."""
    page_kib = os.sysconf("SC_PAGE_SIZE") // 1024
    totals: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != group:
                continue
            resident_pages = int((entry / "statm").read_text().split()[1])
        except (OSError, ValueError):
            continue
        role = _process_role(int(entry.name))
        if role:
            totals[role] = totals.get(role, 0.0) + resident_pages * page_kib / 1024
    return totals


class PeakMemory(threading.Thread):
    """The peak resident memory (MiB) of an app run's process group, per role (``group_rss_mib``)
    and in all (``total``), sampled every ``interval`` seconds until the run ends or ``stop``."""

    def __init__(self, app: AppRun, interval: float) -> None:
        super().__init__(daemon=True)
        self.app, self.interval = app, interval
        self.peaks: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set() and self.app.process.poll() is None:
            sample = group_rss_mib(self.app.process.pid)
            for role, mib in sample.items():
                self.peaks[role] = max(self.peaks.get(role, 0.0), mib)
            self.peaks["total"] = max(self.peaks.get("total", 0.0), sum(sample.values()))
            self.done.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.join(10)
        return self.peaks


def continuous_until_read(run: AppRun, records: int, timeout: float = 1800) -> int:
    """Waits until the continuous engine's batches hold ``records`` records, then stops it by
    SIGTERM (it ends after its cycle, exit 143); 0 for that stop, else its exit code; the bench
    stops when it died first."""
    deadline = time.monotonic() + timeout
    while sum(e["records"] for e in run.events("batch")) < records:
        if run.process.poll() is not None or time.monotonic() > deadline:
            run.kill()
            raise SystemExit(f"continuous engine ended or stalled before reading {records} records:\n"
                             f"{run.log()[-3000:]}")
        time.sleep(0.2)
    run.process.terminate()
    code = run.wait(120)
    return 0 if code == 128 + signal.SIGTERM and run.events("stopped") else code


def warm_cycles(cycles: list[dict[str, Any]]) -> dict[str, Any]:
    """The continuous engine's cycles but the first (its progress rows sum a second's cycles, so
    the cycles' own events count): from the first warm cycle's start to the last commit."""
    warm = cycles[1:]
    seconds = max(c["committed_at"] for c in warm) - warm[0]["started_at"]
    return {"rows": sum(c["records"] for c in warm), "seconds": round(seconds, 3), "clock": "first warm start to last"
            " commit", "phases": [{**{f"sink_{k}": v for k, v in c["timings_ms"].items()}, "rows": c["records"]}
                                  for c in warm]}
