"""Entry point run by spark-submit: Kafka (read_committed) -> PostgreSQL.

    spark-submit --jars <spark-sql-kafka...> spark_apps/eos_stream/app.py --config pipeline.json

Exit codes: 0 finished or stopped on request (also before the first batch);
1 failed (retryable: a supervisor restarts it); 2 configuration error
(retrying will not help); 3 fenced (``fencing.EXIT_FENCED``: this driver no
longer owns the target; start again from the database's offsets, unless a
stop or a recovery holds the pipeline).
Lines starting with ``EOS-`` are machine-readable progress for the supervisor.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

if __package__ in (None, ""):  # run as a file by spark-submit: make `spark_apps` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spark_apps.eos_stream import fencing, kafka_ranges, kafka_security, preflight
from spark_apps.eos_stream.config import ConfigError, PipelineConfig, parse_args
from spark_apps.eos_stream.control import AlreadyRunning, StopSignal
from spark_apps.eos_stream.driver import claim, offsets_json
from spark_apps.eos_stream.errors import sqlstate_of
from spark_apps.eos_stream.events import emit
from spark_apps.eos_stream.kafka_ranges import EARLIEST
from spark_apps.eos_stream.progress import ProgressRecorder, RowsRead
from spark_apps.eos_stream.pyspark_pairing import PysparkPairingError, check_pyspark_pairing
from spark_apps.eos_stream.sink.apply_ahead import ApplyAhead
from spark_apps.eos_stream.sink.batch_sink import StagedBatch
from spark_apps.eos_stream.sink.offsets_store import TopicPartition
from spark_apps.eos_stream.sink.part_writer import driver_part_writer, part_writer
from spark_apps.eos_stream.sink.parts import WrittenParts
from spark_apps.eos_stream.sink.postgres import TargetUnavailable
from spark_apps.eos_stream.sink.staging import range_stager
from spark_apps.eos_stream.spec import SpecError, load_spec

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def _kafka_source_options(config: PipelineConfig) -> dict[str, str]:
    """Options of every Kafka read of the app, streaming or batch."""
    return {
        "kafka.bootstrap.servers": config.kafka_bootstrap,
        # Only committed records: aborted and still-open transactions never reach the DB.
        "kafka.isolation.level": "read_committed",
        "failOnDataLoss": "true",
        # The options are librdkafka's names (the Kafka connection's extra); the source is Java.
        **{f"kafka.{key}": value for key, value in kafka_security.java_options(config.kafka_options).items()},
    }


def _parse_offsets(nested: dict[str, dict[str, int]]) -> dict[TopicPartition, int]:
    return {(topic, int(p)): int(o) for topic, parts in nested.items() for p, o in parts.items()}


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
        return _parse_offsets(json.loads(lines[-1]))


def _run_checkpoint(config: PipelineConfig, mode_stores_offsets: bool, run_id: str) -> str:
    base = f"{config.checkpoint_dir.rstrip('/')}/{config.pipeline}"
    # exactly_once: the database holds the replay point, so every run starts a
    # fresh checkpoint from the stored offsets; a lost or stale checkpoint is
    # harmless. Other modes keep Spark's checkpoint, their only replay point.
    return f"{base}/run-{run_id}" if mode_stores_offsets else f"{base}/{config.delivery}"


def run_stream(config: PipelineConfig) -> int:
    spec = load_spec(config.spec)
    mode = preflight.delivery_mode(config, spec)
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    emit("start", pipeline=config.pipeline, run_id=run_id, config=config.redacted())

    driver = claim(config, spec, mode, run_id)
    if driver is None:
        return EXIT_OK
    dsn, starting = driver.dsn, driver.starting

    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    # Under spark-submit (it passes the gateway port) the application keeps the name it was submitted
    # with, the one a cluster's master lists: eos-<pipeline> for a stream, eos-replay-<pipeline> for a
    # recovery's replay. appName() here would override it.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.appName(f"eos-{config.pipeline}")
    spark = builder.getOrCreate()
    ui_url = spark.sparkContext.uiWebUrl
    if ui_url:  # None when spark.ui.enabled is false
        # The supervisor turns this into the stream task's "Spark driver UI" link.
        emit("ui", url=ui_url, application_id=spark.sparkContext.applicationId)
    checkpoint = _run_checkpoint(config, mode.stores_offsets, run_id)
    offset_log = OffsetLog(spark, checkpoint)

    reader = (
        spark.readStream.format("kafka").options(**_kafka_source_options(config))
        .option("subscribe", ",".join(config.topics))
        .option("maxOffsetsPerTrigger", str(config.max_offsets_per_trigger))
    )
    reader = reader.option("startingOffsets", offsets_json(starting) if mode.stores_offsets else "earliest")
    # Where the source starts this run's first batch: the tasks read from there (kafka_ranges), so it
    # must be the source's own start, the log's start in modes whose replay point is Spark's checkpoint
    # (whatever offsets an earlier exactly_once run of the pipeline stored).
    first_start = starting if mode.stores_offsets else {tp: EARLIEST for tp in starting}
    # Spark's source plans each batch's offset ranges; its tasks read them (kafka_ranges).
    records = reader.load()
    kafka_settings = kafka_ranges.consumer_settings(config.kafka_bootstrap,
                                                    kafka_security.executor_options(config.kafka_options),
                                                    f"eos-stage-{config.pipeline}")
    rows_read = RowsRead()
    write_in_driver = driver_part_writer(dsn, config.spec, config.target_schema, kafka_settings)

    sink = driver.sink()
    # The database is these modes' replay point, so a batch may be checkpointed by
    # Spark before it commits: its apply runs while the next batch stages.
    ahead = ApplyAhead(sink, driver.connect, notify=emit) if mode.stores_offsets else None

    def write_batch(batch_df: Any, batch_id: int) -> None:
        end = offset_log.read(batch_id)
        start = offset_log.read(batch_id - 1) if batch_id > 0 else first_start
        if mode.stores_offsets and (end is None or start is None):
            # Data committed without its end offsets would be applied again by
            # the next run; a wrong start would defeat the ownership check.
            missing = batch_id if end is None else batch_id - 1
            raise RuntimeError(f"Spark's offset log {checkpoint}/offsets has no entry for batch {missing}: "
                               "refusing to commit a batch without the offsets it starts and ends at")
        end = end or {}
        start = start if start is not None else first_start

        started_at = time.time()

        ranges = kafka_ranges.offset_ranges(start, end)

        def on_tasks(task: Callable[[int, Iterable[Any]], Iterator[Any]]) -> list[Any]:
            """Runs ``task`` (task index, its share of the ranges) on the executors and collects
            what each yields. No more tasks than task slots: a Python task costs tens of
            milliseconds of scheduling however little it reads (docs/benchmarks.md)."""
            if not ranges:
                return []
            tasks = min(len(ranges), spark.sparkContext.defaultParallelism)
            return spark.sparkContext.parallelize(ranges, tasks).mapPartitionsWithIndex(task).collect()

        def fill_stage(stage_name: str, keep_raw: bool) -> int:
            """Each Spark task reads its share of the ranges and COPYs it; only its count returns."""
            stager = range_stager(dsn, config.spec, config.meta_schema, stage_name, keep_raw, kafka_settings)
            staged = sum(on_tasks(lambda _index, share: stager(share)))
            rows_read.record(batch_id, staged)
            return staged

        def write_parts(prefix: str) -> list[dict[str, Any]]:
            """Each Spark task writes its share of the ranges as a prepared part, or the driver writes
            a batch of at most ``driver_write_max_records`` as one; their results return."""
            if ranges and sum(r.end - r.start for r in ranges) <= config.driver_write_max_records:
                results = write_in_driver(prefix, ranges)  # no Spark job: its scheduling is a small batch's cost
            else:
                results = on_tasks(part_writer(dsn, config.spec, config.target_schema, prefix, kafka_settings))
            rows_read.record(batch_id, sum(r["rows"] for r in results))
            return results

        def apply(fill_stage: Callable[[str, bool], int], staged: StagedBatch | WrittenParts | None = None) -> None:
            result = sink.process(batch_id, start, end, fill_stage, staged)
            emit("batch", batch_id=batch_id, applied=result.applied, dead_lettered=result.dead_lettered,
                 record_by_record=result.record_by_record, timings_ms=result.timings_ms,
                 transient_retries=result.transient_retries, end_offsets=offsets_json(end),
                 started_at=round(started_at, 3), committed_at=round(time.time(), 3))

        if ahead is None:
            apply(fill_stage)
            return
        ahead.hand_over(batch_id, fill_stage, lambda staged: apply(fill_stage, staged),
                        write_parts if sink.prepared_parts else None)

    spark.streams.addListener(ProgressRecorder(dsn, config.postgres.describe(), config, run_id, rows_read))
    writer = records.writeStream.foreachBatch(write_batch).option("checkpointLocation", checkpoint)
    if config.trigger == "availableNow":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=config.trigger_interval)
    query = writer.queryName(f"eos-{config.pipeline}").start()

    stop = StopSignal(driver.control_conn, config.meta_schema, config.pipeline, config.run_seconds,
                      epoch=driver.epoch, honour_requests=not config.ignore_stop_request)
    try:
        _supervise(query, stop, ahead, config.stop_poll_seconds)
    except Exception:
        if sink.fenced is not None:  # the batch's own reason, not Spark's wrapping of it
            raise fencing.Fenced(sink.fenced) from None
        raise
    finally:
        if ahead is not None:
            ahead.close()
        rows_read.close()  # a batch that never staged (A2, a failed run) no longer holds the listener
    if sink.fenced is not None:
        raise fencing.Fenced(sink.fenced)
    if query.exception() is not None:
        raise RuntimeError(f"streaming query failed: {query.exception()}")
    spark.stop()
    emit("finished", pipeline=config.pipeline, run_id=run_id)
    return EXIT_OK


def _supervise(query: Any, stop: StopSignal, ahead: ApplyAhead | None, poll_seconds: float) -> None:
    """Watches the running query until it ends, is stopped on request or is
    fenced; then waits for the last batch's apply, raising its error."""
    while query.isActive:
        query.awaitTermination(max(1, round(poll_seconds)))  # raises once the query failed
        fenced = stop.fenced() if query.isActive else None
        if fenced:
            # A batch in flight fails its own ownership check; an idle driver
            # must not keep the running lock from its successor.
            stop.at_batch_boundary(query, wait_seconds=30)
            raise fencing.Fenced(fenced)
        reason = stop.requested()
        if reason and query.isActive:
            stop.at_batch_boundary(query)
            if ahead is not None:
                ahead.finish()  # the boundary is the last batch's commit, not Spark's
            emit("stopped", reason=reason)
            return
    if ahead is not None:
        ahead.finish()


# "ValueError: ..." or "psycopg2.errors.StringDataRightTruncation: ..." as Python prints them. The
# class name must hold a lowercase letter: PostgreSQL's message fields (CONTEXT:, DETAIL:, HINT:)
# follow the error in the same text and are not its cause.
_PYTHON_ERROR_LINE = re.compile(r"^\s*((?:[a-z_]\w*\.)*[A-Z]\w*[a-z]\w*): (.+)$")
# Of those, the ones that name an exception: a module-qualified class (psycopg2.errors.X, py4j...)
# or a name ending the way exceptions do. Spark's query report ("Identifier: eos-x [id = ...]",
# "Current Committed Offsets: ...") has the same shape and follows the traceback.
_EXCEPTION_NAME = re.compile(r"(\.|Error$|Exception$|Stuck$|Blocked$|Fenced$|Unavailable$)")


def root_cause(exc: BaseException) -> str:
    """The innermost Python error inside Spark's wrapping (a failed foreachBatch
    arrives as STREAM_FAILED with the real traceback in its text), with the
    SQLSTATE when the database raised it; an error raised outside Spark (the
    last batch's apply, which ends after the query) reads the same way:
    its class, then its first line."""
    text = str(exc)
    lines = [m for m in map(_PYTHON_ERROR_LINE.match, text.splitlines()) if m]
    named = [m for m in lines if _EXCEPTION_NAME.search(m.group(1))] or lines
    if not named:
        return f"{type(exc).__name__}: {text.strip().splitlines()[0]}" if text.strip() else type(exc).__name__
    cause = named[-1].group(1).rsplit(".", 1)[-1] + ": " + named[-1].group(2).strip()
    code = sqlstate_of(exc)
    return f"{cause} (SQLSTATE {code})" if code and code not in cause else cause


def main(argv: list[str] | None = None, run: Callable[[PipelineConfig], int] | None = None) -> int:
    """Runs the pipeline with ``run`` (default: the Spark stream) and turns its
    errors into the exit codes above."""
    try:
        if run is None:
            check_pyspark_pairing()
            run = run_stream
        config = parse_args(argv)
        return run(config)
    except (ConfigError, SpecError, PysparkPairingError, kafka_security.KafkaSecurityError) as exc:
        emit("error", kind="config", message=str(exc))
        print(f"eos-stream: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except fencing.Fenced as exc:
        emit("error", kind="fenced", message=str(exc))
        print(f"eos-stream: fenced: {exc}", file=sys.stderr)
        return fencing.EXIT_FENCED
    except (TargetUnavailable, preflight.KafkaUnavailable, AlreadyRunning) as exc:
        emit("error", kind="unavailable", message=str(exc))
        print(f"eos-stream: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:
        message = root_cause(exc)
        emit("error", kind="failed", message=message[:2000])
        print(f"eos-stream: failed: {message}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
