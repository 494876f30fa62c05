"""StreamingPipelineOperator and StopPipelineOperator against the real stack: a run in
availableNow mode is exact and leaks no password; a SIGKILLed driver is restarted; a poison
record ends in quarantine; exhausted restarts fail clearly; on_kill leaves no JVM; a stop
request ends a processingTime run (after a restart); a fenced driver is restarted at once."""

from __future__ import annotations

import inspect
import ipaddress
import json
import os
import signal
import socket
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pytest
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.operators.stream import StreamingPipelineOperator
from airflow_provider_eos.sensors.stream_progress import StreamCaughtUpSensor
from airflow_provider_eos.state.dead_letters import dead_letters_since
from airflow_provider_eos.state.supervisor_lock import supervisor_running
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.helpers.deferral import run_deferrable
from tests.helpers.kafka import delete_topics, wait_for_markers
from tests.streaming import audit, definition_of, pg_connect, pipeline_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture
def airflow_conns(stack: dict[str, str], monkeypatch) -> dict[str, str]:
    """The connections scripts/airflow.sh writes, as AIRFLOW_CONN_* env vars."""
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT", json.dumps(
        {"conn_type": "kafka", "extra": {"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"]}}))
    monkeypatch.setenv("AIRFLOW_CONN_EOS_POSTGRES", json.dumps(
        {"conn_type": "postgres", "host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
         "login": stack["EOS_PG_USER"], "password": stack["EOS_PG_PASSWORD"], "schema": stack["EOS_PG_DB"]}))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    # The app must get the password from the connection, not from the test's environment.
    monkeypatch.delenv("EOS_PG_PASSWORD", raising=False)
    monkeypatch.delenv("PGPASSWORD", raising=False)
    return stack


class Pipeline:
    """A unique topic, target schema and meta schema; dropped afterwards."""

    def __init__(self, stack: dict[str, str], tmp_path: Path, name: str, partitions: int = 2) -> None:
        self.stack = stack
        self.tmp_path = tmp_path
        self.config = pipeline_config(stack, tmp_path, name)
        self.name = name
        self.topic = self.config["topics"][0]
        ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], self.topic, partitions)

    def produce(self, events: int, **kwargs: Any):
        produced = produce_ledger(self.stack["EOS_KAFKA_BOOTSTRAP"], events, topic=self.topic, **kwargs)
        # A commit returns before its markers land: until then the LSO hides the records, and an
        # availableNow run started at once would end with nothing (seen in CI: 0 of 2000 applied).
        wait_for_markers(self.stack["EOS_KAFKA_BOOTSTRAP"], self.topic)
        return produced

    def operator(self, task_id: str = "run_pipeline", **kwargs: Any) -> StreamingPipelineOperator:
        """The operator over this pipeline's definition; ``kwargs`` that are not the operator's own
        arguments go to the definition's stream section (trigger, trigger_interval...)."""
        own = inspect.signature(StreamingPipelineOperator.__init__).parameters
        args: dict[str, Any] = {"restart_backoff": 0.5, "driver_memory": "1g",
                                "spark_conf": {"spark.sql.shuffle.partitions": "2"}}
        args.update({key: value for key, value in kwargs.items() if key in own})
        stream = {key: value for key, value in kwargs.items() if key not in own}
        return StreamingPipelineOperator(task_id=task_id, definition=definition_of(self.config, stream=stream),
                                         **args)

    def pg(self) -> EosPostgresHook:
        return EosPostgresHook(meta_schema=self.config["meta_schema"])

    def audit(self) -> dict[str, Any]:
        os.environ["EOS_PG_PASSWORD"] = self.stack["EOS_PG_PASSWORD"]  # the audit reads it like the app
        try:
            return audit(self.config, self.tmp_path)
        finally:
            os.environ.pop("EOS_PG_PASSWORD", None)

    def drop(self) -> None:
        conn = pg_connect(self.stack)
        with conn.cursor() as cur:
            for schema in (self.config["target_schema"], self.config["meta_schema"]):
                cur.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn.close()
        delete_topics(self.stack["EOS_KAFKA_BOOTSTRAP"], self.topic)


@pytest.fixture
def make_pipeline(airflow_conns, tmp_path, unique_name):
    made: list[Pipeline] = []

    def make(prefix: str, partitions: int = 2) -> Pipeline:
        pipeline = Pipeline(airflow_conns, tmp_path, f"{prefix}{unique_name}", partitions)
        made.append(pipeline)
        return pipeline

    yield make
    for pipeline in made:
        pipeline.drop()


class Watcher(threading.Thread):
    """Runs ``op.execute`` in a thread; records the live process tree's command lines."""

    def __init__(self, op: StreamingPipelineOperator) -> None:
        super().__init__(daemon=True)
        self.op = op
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.op.execute({})
        except BaseException as err:
            self.error = err

    def live_hook(self, timeout: float = 120, event: str | None = None, after: Any = None) -> Live:
        """The running engine's process and events once ``event`` was seen (``after``: not that run)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = _live(self.op._launcher)
            if live is not None and (after is None or live.source is not after.source):
                if event is None or any(kind == event for kind, _ in live.events):
                    return live
            if not self.is_alive():
                break
            time.sleep(0.2)
        raise AssertionError(f"no live spark-submit (event {event}) within {timeout}s; error: {self.error}")


class Live(NamedTuple):
    """A running engine: what runs it (its launcher's hook, or the launcher), its pid, its events so far."""

    source: Any
    pid: int
    events: list[tuple[str, dict[str, Any]]]


def _live(launcher: Any) -> Live | None:
    """spark-submit: the launcher's hook of this run; the continuous engine: the child-process launcher."""
    hook = getattr(launcher, "hook", None)
    if hook is not None and hook.pid is not None and hook._submit_sp.poll() is None:
        return Live(hook, hook.pid, list(hook.events))
    process = getattr(launcher, "process", None)
    if process is not None and process.poll() is None:
        return Live(launcher, process.pid, list(launcher.event_log.events))
    return None


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cmdline(proc: psutil.Process) -> list[str]:
    """A short-lived child may exit (or linger as a zombie) between listing and reading."""
    try:
        return proc.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return []


def test_available_now_run_is_exact_and_leaks_no_password(make_pipeline, airflow_conns, capfd):
    started = time.monotonic()
    p = make_pipeline("opnow")
    produced = p.produce(2000, abort_every=4)
    secret = airflow_conns["EOS_PG_PASSWORD"]
    watcher = Watcher(p.operator())
    watcher.start()
    hook = watcher.live_hook(event="start")
    cmdlines = [" ".join(_cmdline(proc)) for proc in _tree(hook.pid)]
    environ_has_secret = psutil.Process(hook.pid).environ().get("EOS_PG_PASSWORD") == secret
    watcher.join(240)
    assert watcher.error is None, watcher.error
    summary = watcher.result
    out = capfd.readouterr()
    assert summary["status"] == "finished" and summary["restarts"] == 0
    assert summary["rows_applied"] == produced.committed == 2000
    assert any("eos_stream/app.py" in c for c in cmdlines) and any("java" in c for c in cmdlines)
    assert not any(secret in c for c in cmdlines), "password on a command line"
    assert environ_has_secret, "the app gets the password through its environment"
    log = out.out + out.err
    assert "EOS-BATCH" in log and "EOS-FINISHED" in log, "progress lines belong in the task log"
    assert secret not in log, "password in the task log"
    report = p.audit()
    assert report["ok"], report
    assert report["summary"]["committed_records"] == 2000
    print(f"\navailableNow operator run + audit: {time.monotonic() - started:.1f}s")


@pytest.mark.parametrize("engine", ["spark", "continuous"])
def test_sigkilled_driver_is_restarted_then_a_stop_request_ends_the_run(make_pipeline, engine):
    """Spark (spark-submit, processingTime) and the continuous engine (Spark-less, in its own process
    group): SIGKILL the driver's process group after its first batch; the supervisor restarts it;
    once caught up, StopPipelineOperator stops it; the target is exact."""
    p = make_pipeline("opkill")
    p.produce(3000)
    watcher = Watcher(p.operator(engine=engine, trigger="processingTime", trigger_interval="1 second",
                                 max_offsets_per_trigger=500, max_restarts=2))
    watcher.start()
    first = watcher.live_hook(event="batch")
    os.killpg(first.pid, signal.SIGKILL)  # the whole driver, mid-run
    watcher.live_hook(event="batch", after=first)
    caught_up = StreamCaughtUpSensor(task_id="caught_up", pipeline=p.name, topics=[p.topic],
                                     meta_schema=p.config["meta_schema"], deferrable=False,
                                     poke_interval=1, timeout=180)
    assert caught_up.execute({})["total_lag"] == 0
    assert supervisor_running(p.pg(), p.name)
    # The wait is deferred: the trigger runs here as the triggerer would run it.
    stop = StopPipelineOperator(task_id="stop", pipeline_config=p.config, timeout_seconds=120, poll_interval=0.5,
                                defer_after=0, deferrable=True)
    result, deferred = run_deferrable(stop, {"run_id": "stop-test"})
    watcher.join(30)
    assert deferred, "the supervisor was running: the stop had to wait"
    assert result["stop_requested_at"] and result["epoch"] is None  # a graceful stop does not fence
    assert result["supervisor_running"] is False and result["driver_running"] is False, result
    assert result["last_progress_at"] is not None and result["waited_s"] > 0
    assert watcher.error is None, watcher.error
    summary = watcher.result
    assert summary["status"] == "stopped" and summary["restarts"] == 1, summary
    assert "SIGKILL" in summary["attempts"][0]["reason"]
    assert summary["attempts"][1]["reason"].startswith("stopped (stop requested at")
    report = p.audit()
    assert report["ok"] and report["summary"]["committed_records"] == 3000, report


def test_poison_record_is_quarantined_not_looped(make_pipeline):
    p = make_pipeline("oppois", partitions=1)
    produced = p.produce(300, poison=1)
    assert produced.poison == 1
    summary = p.operator(max_batch_attempts=1, max_restarts=3).execute({})
    assert summary["status"] == "finished", summary
    # The driver counts the failed attempt and isolates the batch itself: no restart is spent on it.
    assert summary["restarts"] == 0, summary
    assert summary["dead_lettered"] == 1
    letters = dead_letters_since(p.pg(), p.name)
    assert len(letters) == 1 and letters[0]["topic"] == p.topic and letters[0]["key_preview"] == "poison"


def test_exhausted_restarts_fail_with_a_clear_message(make_pipeline, monkeypatch):
    p = make_pipeline("opdead")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_NOWHERE", json.dumps(
        {"conn_type": "kafka", "extra": {"bootstrap.servers": f"127.0.0.1:{port}"}}))
    op = p.operator(kafka_config_id="kafka_nowhere", max_restarts=1, restart_backoff=0.1)
    with pytest.raises(AirflowException) as failure:
        op.execute({})
    message = str(failure.value)
    print("\n" + message)
    assert "failed 2 times; restarts exhausted" in message
    assert message.count("unavailable: cannot reach Kafka") == 2


def _spark_ui_page(url: str, path: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=10) as response:
        assert response.status == 200
        return response.read().decode(errors="replace")


def test_on_kill_leaves_no_spark_jvm_and_each_driver_shows_its_own_ui(make_pipeline):
    """Two pipelines at once: each task links to its own driver's UI, on loopback, on a port of
    its own (no 4040 race); the UI serves the Structured Streaming tab. Then on_kill ends both."""
    pipelines = [make_pipeline("oponkill"), make_pipeline("opui")]
    watchers = []
    for p in pipelines:
        p.produce(200)
        watchers.append(Watcher(p.operator(trigger="processingTime", trigger_interval="1 second")))
        watchers[-1].start()
    hooks = [watcher.live_hook(event="batch") for watcher in watchers]
    urls = [watcher.op.spark_ui_url for watcher in watchers]
    ui_events = [[data for kind, data in hook.events if kind == "ui"] for hook in hooks]
    print(f"\nSpark driver UIs: {urls}")
    assert all(url and urllib.parse.urlsplit(url).hostname == "127.0.0.1" for url in urls), urls
    assert len({urllib.parse.urlsplit(url).port for url in urls}) == 2, urls
    assert [events[-1]["url"] for events in ui_events] == urls
    for url in urls:
        assert "Spark Jobs" in _spark_ui_page(url, "/jobs/")
        assert "Streaming Query" in _spark_ui_page(url, "/StreamingQuery/")
    for port in (urllib.parse.urlsplit(url).port for url in urls):  # loopback only, not 0.0.0.0
        listening = [ipaddress.ip_address(c.laddr.ip) for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        # Java may listen on an IPv6 socket bound to the IPv4 loopback (::ffff:127.0.0.1).
        addresses = [getattr(ip, "ipv4_mapped", None) or ip for ip in listening]
        assert addresses and all(ip.is_loopback for ip in addresses), listening
    trees = [_tree(hook.pid) for hook in hooks]
    assert all(any("java" in proc.name() for proc in tree) for tree in trees)
    for watcher in watchers:
        watcher.op.on_kill()
    for watcher, tree, p in zip(watchers, trees, pipelines, strict=True):
        watcher.join(60)
        assert isinstance(watcher.error, AirflowException) and "killed" in str(watcher.error)
        _gone, alive = psutil.wait_procs(tree, timeout=20)
        assert not alive, [(proc.pid, proc.name()) for proc in alive]
        assert not supervisor_running(p.pg(), p.name), "the supervisor lock must be released"


def test_a_fenced_driver_is_restarted_at_once_from_the_database(make_pipeline, airflow_conns):
    """Something takes the target over (a fence operator, a newer driver): the driver exits 3 and
    the supervisor starts a new one at once, not after its restart backoff, which resumes from
    the database's offsets; fenced restarts are counted apart from max_restarts."""
    from spark_apps.eos_stream.state import fencing

    p = make_pipeline("opfence")
    p.produce(1500, seed=41, transactional_id=f"a{p.name}")
    watcher = Watcher(p.operator(trigger="processingTime", trigger_interval="1 second", max_offsets_per_trigger=500,
                                 restart_backoff=600, max_restarts=0))
    watcher.start()
    try:
        first = watcher.live_hook(event="batch", timeout=240)
        conn = pg_connect(airflow_conns)
        conn.autocommit = False
        epoch = fencing.bump_epoch(conn, p.config["meta_schema"], p.name, by="test", reason="fence operator")
        conn.close()
        fenced_at = time.monotonic()
        second = watcher.live_hook(event="resume", after=first, timeout=120)
        restarted_in = time.monotonic() - fenced_at
        p.produce(500, seed=42, first_seq=1500, transactional_id=f"b{p.name}")
        caught_up = StreamCaughtUpSensor(task_id="caught_up", pipeline=p.name, topics=[p.topic],
                                         meta_schema=p.config["meta_schema"], deferrable=False,
                                         poke_interval=1, timeout=180)
        assert caught_up.execute({})["total_lag"] == 0
        StopPipelineOperator(task_id="stop", pipeline_config=p.config, timeout_seconds=120, poll_interval=0.5,
                             deferrable=False).execute({})
        watcher.join(60)
    finally:
        if watcher.is_alive():
            watcher.op.on_kill()
            watcher.join(60)
    assert watcher.error is None, watcher.error
    summary = watcher.result
    print(f"\nfenced at epoch {epoch}: new driver resumed {restarted_in:.1f}s later (backoff would be 600s); "
          f"attempts {[a['reason'][:80] for a in summary['attempts']]}")
    assert summary["status"] == "stopped" and summary["restarts"] == 0 and summary["fenced_restarts"] == 1, summary
    assert summary["attempts"][0]["fenced"] and summary["attempts"][0]["returncode"] == 3, summary["attempts"][0]
    resumed = next(data for kind, data in second.events if kind == "resume")
    assert resumed["epoch"] > epoch
    report = p.audit()
    assert report["ok"] and report["summary"]["committed_records"] == 2000, report
