"""The Spark engine: Spark Structured Streaming reads Kafka (``read_committed``), and each
micro-batch's ``foreachBatch`` hands the batch to the sink (``BatchSink.process``).

    spark-submit --jars <spark-sql-kafka...> spark_apps/eos_stream/app.py --config pipeline.json

``app.py`` is the file spark-submit runs; it calls ``main`` here. The run claims the pipeline
as every engine does (``start.claim``: in-doubt batches committed, a new epoch, the running
lock, prepared parts resolved), starts a query whose source begins at the stored offsets, in a
checkpoint of its own run (``<checkpoint_dir>/<pipeline>/run-<run id>``: the database, never the
checkpoint, is the replay point), and watches it. Spark's source plans each batch's offset
ranges; its tasks read them (``kafka_ranges``) and stage them or write them as prepared parts.
Every failure transition of ``sink/batch_sink.py`` (1-10) and of prepared parts (P1-P6) holds
as it is. Its own transitions:

S1. crash before the first batch commits: nothing written; the rerun claims again (a new
    epoch) and starts from the stored offsets in a new checkpoint.
S2. crash while a batch's tasks stage or write parts, or while it applies: the sink's 1-3 and
    P1, P2; the rerun reads the batch's records again from the stored offsets, and its batches
    need not end where the lost one did.
S3. crash after a batch's commit: its end offsets are stored with its rows (4); the rerun starts
    after them, whatever Spark's checkpoint says.
S4. at_least_once and idempotent: a batch is applied while the next one stages
    (``ApplyAhead``), its offsets stored after its commit; a crash between the two commits
    replays the batch (duplicates in at_least_once; upserts in idempotent).
S5. Spark's offset log has no entry for a batch's start or end (exactly_once, two_phase): the
    batch refuses to commit and the run fails (exit 1).
S6. Kafka no longer holds a record to read: a stored offset below the log start fails the
    claim, and Spark's source fails mid-stream (``failOnDataLoss``); exit 4, nothing committed.
S7. a stop request or ``run_seconds``, polled every ``stop_poll_seconds``: the query stops at
    the running batch's boundary (waited for up to 120 s), the last batch's apply ends, exit 0.
S8. fenced: a batch finds the epoch changed (7) and fails; or the poll finds it while the
    query idles, lets a batch in flight fail its own ownership check (up to 30 s) and stops
    the query. Either way exit 3 with the fence's own reason, not Spark's wrapping of it.
S9. a session lost (a PostgreSQL restart): a batch's sessions are opened again by the sink's
    retry (8, P2); the poll opens its session again at its next poll, and fails the run past
    ``transient_retry_seconds`` (exit 1); the progress listener opens its own again once per
    row (a second failure loses that row; Spark logs it and goes on).
S10. a task or the query fails for another reason (an executor lost, a Kafka error): the run
    fails (exit 1) with the innermost cause; a supervisor restarts it from the stored offsets.
S11. the job that warms the Python workers while the query starts fails (Kafka unreachable, an
    executor lost): only reported (``workers_not_warmed``); the first batch's tasks warm their
    workers themselves, and fail as S10 if the cause lasts.

Exit codes: ``run/entry.py``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from spark_apps.eos_stream import collector, errors
from spark_apps.eos_stream.engines.shared import batch_event, poll_stop
from spark_apps.eos_stream.engines.spark_progress import ProgressRecorder, RowsRead
from spark_apps.eos_stream.engines.start import begin
from spark_apps.eos_stream.events import emit
from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.kafka import security as kafka_security
from spark_apps.eos_stream.kafka.offsets import from_nested
from spark_apps.eos_stream.kafka.offsets import to_json as offsets_to_json
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.spec import SpecSource, StageCount
from spark_apps.eos_stream.run import entry
from spark_apps.eos_stream.run.config import PipelineConfig
from spark_apps.eos_stream.run.entry import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from spark_apps.eos_stream.run.pyspark_pairing import check_pyspark_pairing
from spark_apps.eos_stream.sink.apply_ahead import ApplyAhead
from spark_apps.eos_stream.sink.part_writer import driver_part_writer, part_writer
from spark_apps.eos_stream.sink.parts import WrittenParts
from spark_apps.eos_stream.sink.staging import range_stager, worker_warmer
from spark_apps.eos_stream.sink.writer import StagedBatch
from spark_apps.eos_stream.state import fencing
from spark_apps.eos_stream.state.control import StopSignal

# The exit codes are the app's interface to whoever submits it.
__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "EXIT_OK", "main", "run_stream"]


def _kafka_source_options(config: PipelineConfig) -> dict[str, str]:
    """Options of every Kafka read of the Spark engine, streaming or batch."""
    return {
        "kafka.bootstrap.servers": config.kafka_bootstrap,
        # Only committed records: aborted and still-open transactions never reach the DB.
        "kafka.isolation.level": "read_committed",
        "failOnDataLoss": "true",
        # The options are librdkafka's names (the Kafka connection's extra); the source is Java.
        **{f"kafka.{key}": value for key, value in kafka_security.java_options(config.kafka_options).items()},
    }


class OffsetLog:
    """Reads the offsets Spark wrote ahead of each batch (``<checkpoint>/offsets/<id>``).

    Its end offsets include transaction markers and aborted records that no row
    shows, so storing them lets the stored offset reach the LSO exactly."""

    def __init__(self, spark: Any, checkpoint: str) -> None:
        jvm = spark.sparkContext._jvm
        self._path = jvm.org.apache.hadoop.fs.Path
        self._root = checkpoint.rstrip("/") + "/offsets/"
        self._fs = self._path(self._root).getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        self._jvm = jvm

    def read(self, batch_id: int) -> dict[TopicPartition, int] | None:
        path = self._path(self._root + str(batch_id))
        if not self._fs.exists(path):
            return None
        stream = self._fs.open(path)
        try:
            text = self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8")
        finally:
            stream.close()
        lines = [line for line in text.splitlines() if line.strip()]
        # v1, then batch metadata, then one line per source: ours is the only one.
        return from_nested(json.loads(lines[-1]))


def _run_checkpoint(config: PipelineConfig, run_id: str) -> str:
    # The database holds every mode's replay point (at_least_once and idempotent: the offsets
    # stored after each batch's commit), so every run starts a fresh checkpoint from the stored
    # offsets; a lost or stale checkpoint is harmless, and a pipeline moves between engines.
    return f"{config.checkpoint_dir.rstrip('/')}/{config.pipeline}/run-{run_id}"


def run_stream(config: PipelineConfig) -> int:
    return StreamRun(config).run()


class StreamRun:
    """One run of the Spark stream, in named steps: claim the target (``claim``), start Spark,
    start the query whose ``foreachBatch`` hands each batch to the sink (``write_batch``), and
    watch it until it ends, is stopped or is fenced."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.start = begin(config)
        self.spec, self.mode, self.run_id = self.start.spec, self.start.mode, self.start.run_id
        self.spec_source = SpecSource.of(config)  # what the Spark tasks build the spec from, once per executor

    def run(self) -> int:
        self.start.announce()
        driver = self.start.claim()
        if driver is None:
            return EXIT_OK
        self.driver = driver
        self.dsn, self.starting, self.log_bounds = driver.dsn, driver.starting, driver.log_bounds
        self._start_spark()
        query = self._start_query()
        collector.tune()  # the batches' walks and applies allocate per record, as the tasks do
        return self._watch(query)

    def _start_spark(self) -> None:
        from pyspark.sql import SparkSession

        config = self.config
        builder = SparkSession.builder
        # Under spark-submit (it passes the gateway port) the application keeps the name it was submitted
        # with, the one a cluster's master lists: eos-<pipeline> for a stream, eos-replay-<pipeline> for a
        # recovery's replay. appName() here would override it.
        if "PYSPARK_GATEWAY_PORT" not in os.environ:
            builder = builder.appName(f"eos-{config.pipeline}")
        self.spark = spark = builder.getOrCreate()
        ui_url = spark.sparkContext.uiWebUrl
        if ui_url:  # None when spark.ui.enabled is false
            # The supervisor turns this into the stream task's "Spark driver UI" link.
            emit("ui", url=ui_url, application_id=spark.sparkContext.applicationId)
        self.checkpoint = _run_checkpoint(config, self.run_id)
        self.offset_log = OffsetLog(spark, self.checkpoint)
        self.kafka_settings = kafka_ranges.consumer_settings(config.kafka_bootstrap,
                                                             kafka_security.executor_options(config.kafka_options),
                                                             f"eos-stage-{config.pipeline}")
        self._warm_workers()

    def _source(self) -> Any:
        """The query's Kafka source; sets where its first batch starts and the tasks' consumer settings."""
        config, starting = self.config, self.starting
        # A mirror's pattern also reads topics created later: Spark's source finds them at each
        # trigger and starts them at their earliest offset; the tasks read a partition the
        # batch's start lacks from there too (kafka_ranges.offset_ranges).
        pattern = self.spec.subscription(config.topics)
        subscription = ("subscribePattern", pattern) if pattern else ("subscribe", ",".join(config.topics))
        reader = (
            self.spark.readStream.format("kafka").options(**_kafka_source_options(config))
            .option(*subscription)
            .option("maxOffsetsPerTrigger", str(self._offsets_limit()))
        )
        reader = reader.option("startingOffsets", offsets_to_json(starting))
        # Where the source starts this run's first batch: the tasks read from there (kafka_ranges), so it
        # must be the source's own start.
        self.first_start = starting
        # Spark's source plans each batch's offset ranges; its tasks read them (kafka_ranges).
        records = reader.load()
        self.write_in_driver = driver_part_writer(self.dsn, self.spec, config.target_schema, self.kafka_settings)
        return records

    def _offsets_limit(self) -> int:
        """Spark's ``maxOffsetsPerTrigger``: ``max_offsets_per_trigger``, plus, for a mirror of
        whole transactions, the transaction topic's records in their share of the backlog. They
        are counted, not staged, and would otherwise take more than a quarter of each batch's
        room from the changes with source transactions of 1-8 changes (10 batches for a backlog
        that takes 7)."""
        limit = self.config.max_offsets_per_trigger
        spark_limit = kafka_ranges.limit_with_topic_on_top(limit, self.spec.transaction_topic(), self.starting,
                                                           self.log_bounds)
        if spark_limit != limit:
            emit("offsets_limit", max_offsets_per_trigger=limit, spark_max_offsets_per_trigger=spark_limit,
                 why="the transaction topic's records come on top of the changes' limit")
        return spark_limit

    def _start_query(self) -> Any:
        config = self.config
        records = self._source()
        self.rows_read = RowsRead()
        self.sink = self.driver.sink()
        # The database is these modes' replay point, so a batch may be checkpointed by
        # Spark before it commits: its apply runs while the next batch stages.
        self.ahead = ApplyAhead(self.sink, self.driver.connect, notify=emit) if self.mode.stores_offsets else None
        self.spark.streams.addListener(ProgressRecorder(self.dsn, config.postgres.describe(), config, self.run_id,
                                                        self.rows_read))
        writer = records.writeStream.foreachBatch(self.write_batch).option("checkpointLocation", self.checkpoint)
        if config.trigger == "availableNow":
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=config.trigger_interval)
        return writer.queryName(f"eos-{config.pipeline}").start()

    def _warm_workers(self) -> None:
        """Warms the executors' Python workers (``staging.worker_warmer``) in a job of its own, on
        a thread, while the query is set up and starts: on a local master that start-up was most
        of the first batch's staging (S11)."""
        context = self.spark.sparkContext
        slots = context.defaultParallelism
        warm = worker_warmer(self.spec_source, self.kafka_settings)

        def run() -> None:
            started = time.perf_counter()
            try:
                context.parallelize(range(slots), slots).mapPartitionsWithIndex(warm).collect()
            except Exception as exc:  # an optimisation only
                emit("workers_not_warmed", error=errors.one_line(exc))
                return
            emit("workers_warmed", tasks=slots, ms=round((time.perf_counter() - started) * 1000))

        self.warming = threading.Thread(target=run, name="eos-warm-workers", daemon=True)
        self.warming.start()

    def write_batch(self, batch_df: Any, batch_id: int) -> None:
        """``foreachBatch``: the batch's offsets from Spark's log, then its write (now, or handed
        over to the apply-ahead threads)."""
        end = self.offset_log.read(batch_id)
        start = self.offset_log.read(batch_id - 1) if batch_id > 0 else self.first_start
        if self.mode.stores_offsets and (end is None or start is None):
            # Data committed without its end offsets would be applied again by
            # the next run; a wrong start would defeat the ownership check.
            missing = batch_id if end is None else batch_id - 1
            raise RuntimeError(f"Spark's offset log {self.checkpoint}/offsets has no entry for batch {missing}: "
                               "refusing to commit a batch without the offsets it starts and ends at")
        batch = _BatchWrite(self, batch_id, start if start is not None else self.first_start, end or {})
        if self.ahead is None:
            batch.apply(batch.fill_stage)
            return
        self.ahead.hand_over(batch_id, batch.fill_stage, lambda staged: batch.apply(batch.fill_stage, staged),
                             batch.write_parts if self.sink.prepared_parts else None)

    def _watch(self, query: Any) -> int:
        config, sink, ahead = self.config, self.sink, self.ahead
        stop = self.driver.stop_signal()  # S9: it opens a session lost to a PostgreSQL restart again
        try:
            _supervise(query, stop, ahead, config.stop_poll_seconds)
        except Exception:
            if sink.fenced is not None:  # the batch's own reason, not Spark's wrapping of it
                raise fencing.Fenced(sink.fenced) from None
            raise
        finally:
            if ahead is not None:
                ahead.close()
            self.rows_read.close()  # a batch that never staged (A2, a failed run) no longer holds the listener
        if sink.fenced is not None:
            raise fencing.Fenced(sink.fenced)
        if query.exception() is not None:
            raise RuntimeError(f"streaming query failed: {query.exception()}") from query.exception()
        self.warming.join(timeout=30)  # a run that ends at once: no job cut off by the stop
        self.spark.stop()
        self.start.finished()
        return EXIT_OK


class _BatchWrite:
    """One batch's write: its offset ranges read by the executors, staged or written as parts,
    then applied by the sink."""

    def __init__(self, stream: StreamRun, batch_id: int, start: dict[TopicPartition, int],
                 end: dict[TopicPartition, int]) -> None:
        self.stream, self.batch_id, self.start, self.end = stream, batch_id, start, end
        self.started_at = time.time()
        self.ranges = kafka_ranges.offset_ranges(start, end)

    def on_tasks(self, task: Callable[[int, Iterable[Any]], Iterator[Any]], balanced: bool = False) -> list[Any]:
        """Runs ``task`` (task index, its share of the ranges) on the executors and collects
        what each yields. No more tasks than task slots: a Python task costs tens of
        milliseconds of scheduling however little it reads (docs/benchmarks.md). ``balanced``:
        the shares are of about equal records, a range split between tasks where needed
        (``kafka_ranges.balanced_shares``). Only a stage's shares are: its apply sorts the whole
        batch by offset, while a part is written as its task reads it, so parts keep whole partitions."""
        if not self.ranges:
            return []
        context = self.stream.spark.sparkContext
        if not balanced:
            tasks = min(len(self.ranges), context.defaultParallelism)
            return context.parallelize(self.ranges, tasks).mapPartitionsWithIndex(task).collect()
        mirror = self.stream.spec.mirror
        shares = kafka_ranges.balanced_shares(self.ranges, context.defaultParallelism,
                                              mirror.staging_weights() if mirror is not None else None)
        return (context.parallelize(shares, len(shares))
                .mapPartitionsWithIndex(lambda index, held: task(index, [r for share in held for r in share]))
                .collect())

    def fill_stage(self, stage_name: str, keep_raw: bool) -> StageCount:
        """Each Spark task reads its share of the ranges and COPYs it; only its count returns
        (with a whole mirror's transaction groups), from its successful attempt."""
        stream, config = self.stream, self.stream.config
        stager = range_stager(stream.dsn, stream.spec_source, config.meta_schema, stage_name, keep_raw,
                              stream.kafka_settings)
        staged = StageCount.merged(self.on_tasks(lambda _index, share: stager(share), balanced=True))
        stream.rows_read.record(self.batch_id, staged.rows or 0)
        return staged

    def write_parts(self, prefix: str) -> list[dict[str, Any]]:
        """Each Spark task writes its share of the ranges as a prepared part, or the driver writes a
        batch of at most ``driver_write_max_records`` as one; their results return."""
        stream, config = self.stream, self.stream.config
        if self.ranges and sum(r.end - r.start for r in self.ranges) <= config.driver_write_max_records:
            results = stream.write_in_driver(prefix, self.ranges)  # no Spark job: a small batch's main cost
        else:
            results = self.on_tasks(part_writer(stream.dsn, stream.spec_source, config.target_schema, prefix,
                                                stream.kafka_settings))
        stream.rows_read.record(self.batch_id, sum(r["rows"] for r in results))
        return results

    def apply(self, fill_stage: Callable[[str, bool], StageCount],
              staged: StagedBatch | WrittenParts | None = None) -> None:
        result = self.stream.sink.process(self.batch_id, self.start, self.end, fill_stage, staged)
        batch_event(self.batch_id, result, self.end, started_at=round(self.started_at, 3),
                    committed_at=round(time.time(), 3))


def _supervise(query: Any, stop: StopSignal, ahead: ApplyAhead | None, poll_seconds: float) -> None:
    """Watches the running query until it ends, is stopped on request or is
    fenced; then waits for the last batch's apply, raising its error."""
    while query.isActive:
        query.awaitTermination(max(1, round(poll_seconds)))  # raises once the query failed
        if not query.isActive:
            break
        # S8: a batch in flight fails its own ownership check; an idle driver must not keep the
        # running lock from its successor.
        reason = poll_stop(stop, on_fenced=lambda: stop.at_batch_boundary(query, wait_seconds=30))
        if reason and query.isActive:
            stop.at_batch_boundary(query)
            if ahead is not None:
                ahead.finish()  # the boundary is the last batch's commit, not Spark's
            emit("stopped", reason=reason)
            return
    if ahead is not None:
        ahead.finish()


def main(argv: list[str] | None = None, run: Callable[[PipelineConfig], int] | None = None) -> int:
    """Runs the pipeline with ``run`` (default: the Spark stream) and turns its
    errors into the exit codes of ``run.entry``."""
    if run is None:
        return entry.main(argv, run_stream, before=check_pyspark_pairing)
    return entry.main(argv, run)
