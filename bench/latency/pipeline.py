"""One probed pipeline: its topic and targets, the app under spark-submit (or the continuous engine), the memory
of its processes, a graceful stop, an exactness check and the clean-up."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from psycopg2 import sql

from bench.common import PARTITIONS, drop_schemas
from bench.harness import AppRun, pg_connect, pipeline_config, start_app, start_continuous
from bench.latency.probe import Watcher, start_producer
from spark_apps.eos_stream.records.spec import load_spec
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.sink.modes import MODES
from spark_apps.eos_stream.state import meta_tables
from spark_apps.ledger.generator import ensure_topic, produce_ledger

# delivery -> the ledger spec it runs (idempotent accepts only row targets)
SPECS = {"exactly_once": "LEDGER", "at_least_once": "LEDGER", "two_phase": "LEDGER",
         "idempotent": "LEDGER_EVENTS_ONLY"}
WATCHER_INDEX = "ledger_events_latency_watch"
# Events in the topic before the app starts: its first batch (JVM and Python workers warming up) has
# something to commit, which tells the bench the app is up. Their seq are below the probe's.
SEED_EVENTS = 100


@dataclass
class Case:
    delivery: str
    trigger_seconds: float
    rate: int
    warmup: float
    measure: float
    interval: float = 0.05  # a producer transaction every 50 ms
    poll: float = 0.02  # the watcher's period
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the app
    keep_logs: Path | None = None  # where each app's log is copied (None: not kept)
    app: dict[str, Any] = field(default_factory=dict)  # app config keys over the bench's
    spark_conf: dict[str, str] = field(default_factory=dict)  # spark-submit --conf properties (Spark only)
    engine: str = "spark"  # or "continuous": the Spark-less engine (the config's engine)

    @property
    def trigger_label(self) -> str:
        """How the case's trigger is reported: "continuous", or the Spark interval as "0s"."""
        return "continuous" if self.engine == "continuous" else f"{self.trigger_seconds:g}s"

    @property
    def trigger_interval(self) -> str:
        return f"{self.trigger_seconds:g} seconds"


def _targets(stack: dict[str, str], config: dict[str, Any]) -> None:
    """The targets, created before the app so the watcher's index is there before the first
    row: (kafka_topic, kafka_partition, kafka_offset), the index idempotent delivery has anyway
    (unique there), so every mode pays the same index maintenance."""
    mode = MODES[config["delivery"]]
    conn = pg_connect(stack)
    conn.autocommit = False
    try:
        preflight.create_targets(conn, load_spec(config["spec"]), config["target_schema"], mode)
        if not mode.upsert_rows:
            with conn.cursor() as cur:
                cur.execute(sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (kafka_topic, kafka_partition, kafka_offset)")
                            .format(sql.Identifier(WATCHER_INDEX),
                                    sql.Identifier(config["target_schema"], "ledger_events")))
            conn.commit()
    finally:
        conn.close()


def _request_stop(stack: dict[str, str], config: dict[str, Any]) -> None:
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL(
                "INSERT INTO {} (pipeline, stop_requested_at, requested_by) VALUES (%s, now(), 'latency bench')"
                " ON CONFLICT (pipeline) DO UPDATE SET stop_requested_at = now(), requested_by = 'latency bench'"
            ).format(meta_tables.table(config["meta_schema"], meta_tables.CONTROL)), (config["pipeline"],))
    finally:
        conn.close()


def _kind(process: psutil.Process) -> str | None:
    """driver_jvm, driver_python or python_worker (None: another process of the tree)."""
    try:
        cmdline = " ".join(process.cmdline())
    except psutil.Error:
        return None
    if "java" in process.name() and "SparkSubmit" in cmdline:
        return "driver_jvm"
    if "pyspark.daemon" in cmdline or "pyspark.worker" in cmdline or "pyspark/daemon" in cmdline:
        return "python_worker"
    if "python" in process.name() and "app.py" in cmdline:
        return "driver_python"
    if "python" in process.name() and "eos_stream.engines.continuous" in cmdline:
        return "continuous_engine"
    return None


class MemorySampler:
    """RSS of the app's process tree every ``every`` seconds: per kind, each process's MB
    and their sum; the samples' medians are the figure (the peak is kept too)."""

    def __init__(self, pid: int, every: float = 1.0) -> None:
        self.root, self.every = pid, every
        self.samples: list[dict[str, list[float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                tree = [psutil.Process(self.root), *psutil.Process(self.root).children(recursive=True)]
            except psutil.Error:
                return
            sample: dict[str, list[float]] = {}
            for process in tree:
                kind = _kind(process)
                try:
                    if kind:
                        sample.setdefault(kind, []).append(round(process.memory_info().rss / 2**20, 1))
                except psutil.Error:
                    continue
            self.samples.append(sample)

    def result(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        if not self.samples:
            return {}
        kinds = sorted({k for s in self.samples for k in s})
        out: dict[str, Any] = {}
        for kind in kinds:
            totals = [sum(s.get(kind, [])) for s in self.samples]
            last = next(s[kind] for s in reversed(self.samples) if kind in s)
            out[kind] = {"median_mb": round(statistics.median(totals), 1), "peak_mb": max(totals),
                         "processes_mb": sorted(last, reverse=True)}
        out["total_median_mb"] = round(sum(v["median_mb"] for v in out.values()), 1)
        return out


def _first_batch(run: AppRun, timeout: float) -> None:
    """Waits for the app's first committed batch: the JVM and the Python workers are up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.process.poll() is not None:
            raise RuntimeError(f"the app exited ({run.process.returncode}):\n{run.log()[-3000:]}")
        if run.events("batch") or run.events("progress"):
            return
        time.sleep(0.5)
    raise RuntimeError(f"no batch in {timeout:.0f} s:\n{run.log()[-3000:]}")


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:  # nearest rank
        return round(ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))], 1)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": round(ordered[-1], 1)}


class ProbedPipeline:
    """A pipeline and its probe: ``start`` (app up, first batch in), ``probe`` (produce,
    watch), ``finish`` (stop, check, clean up)."""

    def __init__(self, stack: dict[str, str], tmp: Path, case: Case, seed: int) -> None:
        self.stack, self.tmp, self.case, self.seed = stack, tmp, case, seed
        name = f"lat{uuid.uuid4().hex[:8]}"
        self.topic = f"bench.latency.{name}"
        self.config = pipeline_config(
            stack, tmp, name, delivery=case.delivery, spec=f"spark_apps.ledger.spec:{SPECS[case.delivery]}",
            topics=[self.topic], engine=case.engine, trigger="processingTime",
            trigger_interval=case.trigger_interval,
            max_offsets_per_trigger=1_000_000, **case.app)
        self.run: AppRun | None = None
        self.memory: MemorySampler | None = None
        self.watcher = Watcher(lambda: pg_connect(stack), self.config["target_schema"], self.topic,
                               aggregate=SPECS[case.delivery] == "LEDGER", poll=case.poll)

    def start(self, startup_timeout: float = 240) -> None:
        ensure_topic(self.stack["EOS_KAFKA_BOOTSTRAP"], self.topic, partitions=PARTITIONS)
        _targets(self.stack, self.config)
        produce_ledger(self.stack["EOS_KAFKA_BOOTSTRAP"], SEED_EVENTS, topic=self.topic, batch_size=SEED_EVENTS,
                       transactional_id=f"seed-{self.config['pipeline']}")
        if self.case.engine == "continuous":
            self.run = start_continuous(self.config, self.tmp, env_extra=self.case.env or None,
                                        label=self.config["pipeline"])
        else:
            self.run = start_app(self.config, self.tmp, env_extra=self.case.env or None, label=self.config["pipeline"],
                                 spark_conf=self.case.spark_conf)
        _first_batch(self.run, startup_timeout)

    def probe(self) -> None:
        """Produces for warm-up + measure seconds while the watcher polls (this thread)."""
        assert self.run is not None
        seconds = self.case.warmup + self.case.measure
        producer, reports = start_producer(self.stack["EOS_KAFKA_BOOTSTRAP"], self.topic, self.case.rate,
                                           self.case.interval, seconds, self.seed)
        self.started = time.monotonic()
        self.memory = MemorySampler(self.run.process.pid)
        self.watcher.run(reports, threading.Event(), drain_seconds=self.case.trigger_seconds + 30)
        producer.join(30)

    def finish(self) -> dict[str, Any]:
        assert self.run is not None
        memory = self.memory.result() if self.memory else {}
        _request_stop(self.stack, self.config)
        try:
            self.run.wait(120)
        except subprocess.TimeoutExpired:
            self.run.kill()
        exact = self._exactness()
        batches = self.run.events("batch")
        spark_ms = self._spark_durations()
        if self.case.keep_logs:
            self.case.keep_logs.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.run.log_path, self.case.keep_logs / f"{self.config['pipeline']}.log")
        self._forget()
        return {**self.result(), "memory": memory, "exact": exact, "batches": len(batches),
                "sink_ms": _median_timings([b.get("timings_ms", {}) for b in batches[1:]]),
                "spark_ms": spark_ms, "app_log": self.config["pipeline"] if self.case.keep_logs else None,
                "exit_code": self.run.process.returncode}

    def _spark_durations(self) -> dict[str, float]:
        """Spark's durationMs per batch (latestOffset, walCommit, addBatch, commitOffsets,
        triggerExecution...), median over the batches after the first."""
        conn = pg_connect(self.stack)
        try:
            with conn.cursor() as cur:
                cur.execute(sql.SQL("SELECT durations_ms FROM {} WHERE pipeline = %s ORDER BY batch_id").format(
                    meta_tables.table(self.config["meta_schema"], meta_tables.PROGRESS)), (self.config["pipeline"],))
                rows = [d if isinstance(d, dict) else json.loads(d or "{}") for (d,) in cur.fetchall()]
        finally:
            conn.close()
        return _median_timings(rows[1:])

    def result(self) -> dict[str, Any]:
        transactions = self.watcher.transactions
        if not transactions:
            return {"transactions": 0}
        first = transactions[0].committed_at
        window = [t for t in transactions if self.case.warmup <= t.committed_at - first]
        latencies = [(t.visible_at - t.committed_at) * 1000 for t in window if t.visible_at is not None]
        return {**percentiles(latencies), "transactions": len(window),
                "never_visible": sum(1 for t in window if t.visible_at is None),
                "producer_late_transactions": self.watcher.late_transactions,
                "polls": self.watcher.polls, "poll_ms_p50": percentiles(self.watcher.poll_ms)["p50"],
                "poll_ms_p99": percentiles(self.watcher.poll_ms)["p99"]}

    def _exactness(self) -> dict[str, Any]:
        """Rows in the row target against the records produced: a latency of an inexact run
        would mean nothing."""
        produced = SEED_EVENTS + sum(last - first + 1 for t in self.watcher.transactions
                                     for first, last in t.ranges.values())
        conn = pg_connect(self.stack)
        try:
            with conn.cursor() as cur:
                cur.execute(sql.SQL("SELECT count(*), count(DISTINCT (kafka_partition, kafka_offset)) FROM {}")
                            .format(sql.Identifier(self.config["target_schema"], "ledger_events")))
                rows, distinct = cur.fetchone()
        finally:
            conn.close()
        return {"produced": produced, "rows": rows, "distinct": distinct, "ok": rows == distinct == produced}

    def _forget(self) -> None:
        from confluent_kafka.admin import AdminClient

        conn = pg_connect(self.stack)
        try:
            with conn.cursor() as cur:  # parts a killed app left would hold locks on the target
                cur.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s",
                            (f"%{self.config['pipeline']}%",))
                for (gid,) in cur.fetchall():
                    cur.execute("ROLLBACK PREPARED %s", (gid,))
            drop_schemas(conn, self.config["target_schema"], self.config["meta_schema"])
        finally:
            conn.close()
        admin = AdminClient({"bootstrap.servers": self.stack["EOS_KAFKA_BOOTSTRAP"]})
        for future in admin.delete_topics([self.topic], operation_timeout=60).values():
            future.result()


def _median_timings(batches: list[dict[str, Any]]) -> dict[str, float]:
    """Per key, the median over ``batches`` (a key a batch lacks counts 0)."""
    keys = sorted({k for b in batches for k in b})
    return {k: statistics.median(b.get(k, 0) for b in batches) for k in keys}
