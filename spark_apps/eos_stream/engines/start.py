"""How every engine starts a run, before its first batch: the spec, the delivery mode and a
run id (``begin``), the claim (``claim``) and the Kafka consumer of an engine that reads in
its own process (``open_consumer``).

The Spark engine (``spark.py``), the continuous engine (``continuous.py``) and the direct
replay (``direct_replay.py``) all start here. A claimed driver holds three connections, the
pipeline's new epoch and its running lock, and knows where the database says to resume; its
stop-and-fence poll (``Driver.stop_signal``) reads on the third.
"""

from __future__ import annotations

import importlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream.events import emit
from spark_apps.eos_stream.kafka import lost_data
from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.kafka.client_logs import with_python_logging
from spark_apps.eos_stream.kafka.offsets import to_json as offsets_to_json
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.kafka.ranges import EARLIEST
from spark_apps.eos_stream.records.spec import PipelineSpec, spec_of
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.run.config import PipelineConfig
from spark_apps.eos_stream.run.config_rules import ConfigError
from spark_apps.eos_stream.sink import parts
from spark_apps.eos_stream.sink.batch_sink import BatchSink, Stopwatch
from spark_apps.eos_stream.sink.in_doubt import resolve_in_doubt
from spark_apps.eos_stream.sink.modes import DeliveryMode
from spark_apps.eos_stream.sink.offsets_store import OffsetsStore
from spark_apps.eos_stream.sink.postgres import connect
from spark_apps.eos_stream.sink.settings import SinkSettings
from spark_apps.eos_stream.sink.staging import drop_stages
from spark_apps.eos_stream.state import fencing
from spark_apps.eos_stream.state.control import StopSignal, hold_running_lock, stop_requested


@dataclass(frozen=True)
class Start:
    """A run before its claim: the config, the loaded spec, the delivery mode and the run id.

    :param engine: the engine's name in the ``start`` and ``finished`` events (None: the
        Spark engine, whose events carry no name).
    """

    config: PipelineConfig
    spec: PipelineSpec
    mode: DeliveryMode
    run_id: str
    engine: str | None = None

    def announce(self, **extra: Any) -> None:
        """The ``start`` event: the pipeline, the run id and the config without secrets."""
        emit("start", pipeline=self.config.pipeline, run_id=self.run_id, config=self.config.redacted(),
             **self._named(), **extra)

    def finished(self) -> None:
        emit("finished", pipeline=self.config.pipeline, run_id=self.run_id, **self._named())

    def claim(self) -> Driver | None:
        return claim(self.config, self.spec, self.mode, self.run_id)

    def _named(self) -> dict[str, str]:
        return {"engine": self.engine} if self.engine else {}


def begin(config: PipelineConfig, engine: str | None = None) -> Start:
    """The spec loaded, the delivery mode decided (``preflight.delivery_mode``: a config error
    raises here, before any connection) and a run id: the time, the engine's name, six hex
    digits."""
    spec = spec_of(config)
    mode = preflight.delivery_mode(config, spec)
    run_id = "-".join([time.strftime("%Y%m%dT%H%M%S"), *([engine] if engine else []), uuid.uuid4().hex[:6]])
    return Start(config, spec, mode, run_id, engine)


def open_consumer(config: PipelineConfig, group_prefix: str, **overrides: Any) -> Any:
    """A ``read_committed`` consumer for an engine that reads Kafka in its own process: a range
    reader's settings (``kafka_ranges``) with librdkafka's own prefetch depth (100,000 records),
    which keeps it fed from one batch to the next, and ``overrides`` on top."""
    from confluent_kafka import Consumer

    settings = kafka_ranges.consumer_settings(config.kafka_bootstrap, config.librdkafka_options(),
                                              f"{group_prefix}-{config.pipeline}", prefetch_records=100_000)
    return Consumer(with_python_logging({**settings, **overrides}))


@dataclass
class Driver:
    """A driver that owns its pipeline from ``epoch`` on.

    :param starting: every partition's first offset to read: the stored next
        offset, or EARLIEST for a partition never applied.
    """

    config: PipelineConfig
    spec: PipelineSpec
    mode: DeliveryMode
    run_id: str
    conn: PgConnection
    guard_conn: PgConnection
    control_conn: PgConnection
    epoch: int
    starting: dict[TopicPartition, int]
    # Batches are written as prepared parts (``sink.parts``) before falling back to staging.
    prepared_parts: bool = False
    # Each partition's (log start, high watermark) at the claim; empty unless the mode stores offsets.
    log_bounds: dict[TopicPartition, tuple[int, int]] = field(default_factory=dict)
    # The stop-and-fence poll, once ``stop_signal`` made it: its session replaces control_conn.
    stop: StopSignal | None = field(default=None, repr=False)

    @property
    def dsn(self) -> dict[str, Any]:
        return self.config.postgres.dsn_kwargs()

    def connect(self) -> PgConnection:
        return connect(self.dsn, describe=self.config.postgres.describe())

    def sink(self) -> BatchSink:
        settings = SinkSettings.of(self.config, self.spec, self.mode, epoch=self.epoch,
                                   prepared_parts=self.prepared_parts)
        return BatchSink(settings, conn=self.conn, guard_conn=self.guard_conn, reconnect=self.connect,
                         reconnect_guard=self.reconnect_guard, notify=emit)

    def reconnect_guard(self) -> PgConnection:
        """A new guard connection that holds the running lock again: the old
        one's session, and the lock with it, died. Another driver that took
        the lock meanwhile fails this one (``AlreadyRunning``); one that also
        bumped the epoch fences it at its next batch."""
        conn = self.connect()
        hold_running_lock(conn, self.config.pipeline)
        self.guard_conn = conn
        return conn

    def stop_signal(self) -> StopSignal:
        """The stop-and-fence poll on the control session. A PostgreSQL restart cuts that
        session too: the poll opens it again, within the time a batch may spend on transient
        errors (``transient_retry_seconds``), and ``close`` closes the poll's session then."""
        config = self.config
        self.stop = StopSignal(self.control_conn, config.meta_schema, config.pipeline, config.run_seconds,
                               epoch=self.epoch, honour_requests=not config.ignore_stop_request,
                               reconnect=self.connect, outage_seconds=config.transient_retry_seconds)
        return self.stop

    def close(self) -> None:
        """Closing the guard connection releases the running lock."""
        _close([self.conn, self.guard_conn, self.stop.conn if self.stop is not None else self.control_conn])


def import_in_background(module: str) -> None:
    """Imports ``module`` in a daemon thread. pyarrow imports pandas at the first array it builds
    from Python objects, about 0.8 s of a 20k-record replay's 2.5 s on the 2-core Intel VM: started
    before the claim, that import runs while the main thread waits on Kafka and PostgreSQL (the
    compaction check, the claim, the offsets); the first batch's import then finds it done or waits
    for it."""
    threading.Thread(target=importlib.import_module, args=(module,), name=f"import-{module}", daemon=True).start()


def claim(config: PipelineConfig, spec: PipelineSpec, mode: DeliveryMode, run_id: str) -> Driver | None:
    """Claims the pipeline, or returns None (after an ``EOS-STOPPED`` line)
    when a stop request it honours holds it. A claim that fails or returns None closes the
    sessions it opened (the running lock with them): a claim tried again never waits on its own."""
    laps = Stopwatch()  # each step's time, in the resume event: where a slow start went
    describe = config.postgres.describe()
    opened: list[PgConnection] = []
    try:
        for _ in range(3):
            opened.append(connect(config.postgres.dsn_kwargs(), describe=describe))
        driver = _claim(config, spec, mode, run_id, laps, *opened)
    except BaseException:
        _close(opened)
        raise
    if driver is None:
        _close(opened)
    return driver


def _close(conns: list[PgConnection]) -> None:
    for conn in conns:
        if not conn.closed:
            conn.close()


class _Claimed(NamedTuple):
    epoch: int
    in_doubt: list[dict[str, str]]  # the batches a dead driver left prepared, committed now
    parts: dict[str, list[str]]  # its prepared parts, committed or rolled back now


class _ResumePoint(NamedTuple):
    starting: dict[TopicPartition, int]  # each partition's stored offset, else EARLIEST
    log_bounds: dict[TopicPartition, tuple[int, int]]  # the logs' bounds, checked against them
    stages_dropped: int  # stale staging tables of a crashed driver
    stored: dict[TopicPartition, int]


def _claim(config: PipelineConfig, spec: PipelineSpec, mode: DeliveryMode, run_id: str, laps: Stopwatch,
           conn: PgConnection, guard_conn: PgConnection, control_conn: PgConnection) -> Driver | None:
    """``claim``'s steps, on its three sessions: the pipeline fenced and locked, then its resume point."""
    claimed = _fence_and_lock(config, mode, run_id, laps, conn, guard_conn, control_conn)
    if claimed is None:
        return None
    if config.create_targets:
        preflight.create_targets(conn, spec, config.target_schema, mode)
    preflight.check_targets(conn, spec, config.target_schema, mode)
    laps.lap("targets")
    resume = _resume_point(config, spec, mode, laps, conn)
    write_parts, why = preflight.prepared_parts(conn, spec, mode)
    emit("resume", stored_offsets=offsets_to_json(resume.stored), stale_stages_dropped=resume.stages_dropped,
         in_doubt_committed=[t["gid"] for t in claimed.in_doubt], parts_committed=claimed.parts["committed"],
         parts_rolled_back=claimed.parts["rolled_back"], epoch=claimed.epoch,
         write_path="prepared_parts" if write_parts else "staged", write_path_reason=why,
         claim_ms={**laps.laps, "rest": laps.lap("rest")})
    return Driver(config, spec, mode, run_id, conn, guard_conn, control_conn, claimed.epoch, resume.starting,
                  write_parts, log_bounds=resume.log_bounds)


def _fence_and_lock(config: PipelineConfig, mode: DeliveryMode, run_id: str, laps: Stopwatch, conn: PgConnection,
                    guard_conn: PgConnection, control_conn: PgConnection
                    ) -> _Claimed | None:
    """The pipeline claimed for this driver: (its epoch, the in-doubt batches committed, the
    prepared parts resolved), or None when a stop was requested (the driver then exits)."""
    describe = config.postgres.describe()
    control_conn.autocommit = True  # polled from the main thread while the sink's transaction runs on another
    preflight.check_two_phase(conn, mode, describe)
    preflight.check_encoding(conn, describe)
    # First of all: an in-doubt batch of a dead driver holds locks on the
    # pipeline's tables (DDL below would wait on it) and the pipeline lock
    # (the epoch bump would), and its offsets are part of the resume point.
    laps.lap("connect")
    in_doubt = resolve_in_doubt(conn, config.pipeline)
    preflight.ensure_meta_tables(conn, config.meta_schema)
    laps.lap("in_doubt_and_meta_tables")
    honour_stop = not config.ignore_stop_request
    # A driver about to honour a stop must not fence anyone on its way out
    # (the recovery's replay run may be the one writing).
    if honour_stop and (reason := stop_requested(control_conn, config.meta_schema, config.pipeline)):
        emit("stopped", reason=reason, before_first_batch=True)
        return None
    # Claim the pipeline like Kafka's init_transactions: any older driver (an
    # orphan of a dead supervisor) can commit nothing from here on, notices
    # within stop_poll_seconds and exits, freeing the running lock below.
    epoch = fencing.bump_epoch(conn, config.meta_schema, config.pipeline, by=run_id, reason="driver start")
    # P1, P4: every older epoch is fenced now, so none of its undecided parts can be decided
    # any more; the decided ones are finished, as their driver was about to.
    laps.lap("epoch")
    resolved_parts = parts.resolve(conn, config.meta_schema, config.pipeline)
    laps.lap("parts")
    hold_running_lock(guard_conn, config.pipeline)
    laps.lap("running_lock")
    with control_conn.cursor() as cur:
        now = fencing.current_epoch(cur, config.meta_schema, config.pipeline)
    if now != epoch:  # a newer driver or a recovery claimed it while this one waited for the lock
        raise fencing.Fenced(f"pipeline {config.pipeline!r} was fenced while this driver waited for its "
                             f"running lock: its epoch is {now}, this driver got {epoch}")
    # A stop requested while the running lock was still held by the previous
    # driver: a supervisor's restart must not slip a batch in under a recovery.
    if honour_stop and (reason := stop_requested(control_conn, config.meta_schema, config.pipeline)):
        emit("stopped", reason=reason, before_first_batch=True)
        return None
    return _Claimed(epoch, in_doubt, resolved_parts)


def _resume_point(config: PipelineConfig, spec: PipelineSpec, mode: DeliveryMode, laps: Stopwatch,
                  conn: PgConnection) -> _ResumePoint:
    """Where each partition starts (its stored offset, else the earliest), the logs' bounds
    checked against them, the stale stages dropped, and the stored offsets."""
    # A subscription by pattern reads every topic it matches now (a topic created later is read
    # from its first offset: Spark's source starts a partition it discovers at the earliest).
    partitions = preflight.kafka_partitions(config.kafka_bootstrap, config.topics, config.librdkafka_options(),
                                            pattern=spec.subscription(config.topics))
    laps.lap("kafka_partitions")
    dropped = drop_stages(conn, config.meta_schema, config.pipeline)

    stored = OffsetsStore(config.meta_schema, config.pipeline).load(conn)
    conn.rollback()
    if problem := preflight.transaction_topic_problem(spec.transaction_topic(), partitions, stored):
        raise ConfigError(problem)
    starting = {(t, p): stored.get((t, p), EARLIEST) for t, ps in partitions.items() for p in ps}
    bounds: dict[TopicPartition, tuple[int, int]] = {}
    if mode.stores_offsets:
        # The resume point must still be in Kafka: a stored offset below the log start (retention)
        # or past its end (a recreated topic) fails here, before Spark, naming each partition. The
        # other modes' offsets, stored after the data, meet the loss in the read (Spark's source).
        bounds = lost_data.check_stored_offsets(config.pipeline, config.kafka_bootstrap,
                                                config.librdkafka_options(), stored, sorted(starting))
        laps.lap("log_bounds")
    return _ResumePoint(starting, bounds, dropped, stored)

