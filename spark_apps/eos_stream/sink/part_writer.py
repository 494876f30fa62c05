"""The writer of a part (``sink.parts``): what one Spark task runs on its share of a batch.

It reads its offset ranges (``kafka_ranges``), has Arrow parse the records
Arrow vouches for (``batch_lines``) and ``records.parse_record`` the rest,
COPYs the typed rows straight into the row target in a transaction of its own,
sums the aggregate deltas of the same rows (``aggregate_deltas``) and ends
with PREPARE TRANSACTION. Nothing is visible until the driver's decision and
the committer's COMMIT PREPARED.

A task never judges a record it cannot write: a record Python refuses (it
would be a dead letter) or a COPY the database refuses (a value, a
constraint, no free prepared-transaction slot) rolls the part back and the
task reports *why* instead of a part. The driver then writes the whole batch
the staged way, where each record gets the database's own verdict and its
dead letter (``batch_sink``). An error of Kafka or of the task itself fails
the task, as staging does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg2
from psycopg2 import sql

from spark_apps.eos_stream import collector, errors
from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.records import aggregate_deltas, batch_lines
from spark_apps.eos_stream.records.parsing import RecordError, parse_record
from spark_apps.eos_stream.records.spec import SOURCE_COLUMNS, PipelineSpec, RowTarget, SpecSource
from spark_apps.eos_stream.sink.parts import aggregate_targets
from spark_apps.eos_stream.sink.staging import copy_from_chunks

# A task's deltas hold one entry per key: past this many a part is refused, so a task's memory
# stays bounded by its chunk and this, and an aggregate of very many keys is grouped by PostgreSQL.
MAX_DELTA_KEYS = 100_000


class PartRefused(Exception):
    """The task's records cannot all be written as a part; the message says which and why."""


def part_result(gid: str | None, rows: int, deltas: aggregate_deltas.Deltas | None = None,
                refused: str | None = None) -> dict[str, Any]:
    """What a task reports to the driver (plain values: it is pickled)."""
    return {"gid": gid, "rows": rows, "deltas": aggregate_deltas.to_wire(deltas or []), "refused": refused}


def _typed_rows(batch: Any, spec: PipelineSpec) -> Iterator[tuple[Any, Any, Any, bool]]:
    """(coordinates batch, mask, typed fields, escaped) of an Arrow batch of records, first
    the ones Arrow vouches for, then the rest as ``parse_record`` reads them; raises
    PartRefused for a record Python refuses."""
    import pyarrow as pa
    import pyarrow.compute as pc

    vouched, fields, escaped = batch_lines.vouched_fields(batch, spec)
    if fields is not None:
        yield batch, vouched, fields, escaped
    left = batch.filter(pc.invert(vouched))
    if not left.num_rows:
        return
    values = []
    for topic, partition, offset, _key, value in batch_lines.arrow_records(left):
        try:
            values.append(parse_record(spec, value))
        except RecordError as exc:
            raise PartRefused(f"{topic}[{partition}] offset {offset} is malformed ({exc})") from None
    try:
        parsed = pa.RecordBatch.from_pylist(values, schema=batch_lines.arrow_schema(spec))
    except (pa.ArrowInvalid, OverflowError) as exc:  # a value past int64: the database's verdict decides
        raise PartRefused(f"a value Arrow cannot hold: {exc}") from None
    yield left, pa.repeat(True, left.num_rows), parsed, True


def _with_positions(batch: Any, mask: Any, fields: Any) -> Any:
    """The typed fields with each record's ``_partition`` and ``_offset`` (for the deltas)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = pa.Table.from_batches([fields])
    table = table.append_column("_partition", pc.filter(batch.column(1), mask))
    return table.append_column("_offset", pc.filter(batch.column(2), mask))


def part_chunks(batches: Iterable[Any], spec: PipelineSpec, row_target: RowTarget | None,
                deltas: aggregate_deltas.Deltas, counts: dict[str, int]) -> Iterator[memoryview]:
    """The row target's COPY data of a task's Arrow batches of records; adds each batch's
    records to ``deltas`` and counts them in ``counts["rows"]``."""
    targets = aggregate_targets(spec)
    for batch in batches:
        for coordinates, mask, fields, escaped in _typed_rows(batch, spec):
            counts["rows"] += fields.num_rows
            if targets:
                aggregate_deltas.add_table(deltas, targets, _with_positions(coordinates, mask, fields))
                if max(len(d) for d in deltas) > MAX_DELTA_KEYS:
                    raise PartRefused(f"more than {MAX_DELTA_KEYS:,} keys of one aggregate in one task: "
                                      "the staged apply groups them in the database instead")
            if row_target is not None:
                yield batch_lines.copy_text([*batch_lines.coordinate_cells(coordinates, mask),
                                             *batch_lines.field_cells(fields, spec, row_target.columns, escaped)])


def write_part(dsn_kwargs: dict[str, Any], spec: PipelineSpec, target_schema: str, gid: str, consumer: Any,
               ranges: Iterable[kafka_ranges.OffsetRange]) -> dict[str, Any]:
    """Writes ``ranges`` as one prepared part named ``gid``; returns ``part_result``."""
    reader = kafka_ranges.record_batches(consumer, ranges)
    try:
        return write_part_batches(dsn_kwargs, spec, target_schema, gid, reader)
    finally:
        # A part refused mid-read leaves the reader suspended: closed here, it unassigns the
        # consumer now, not at a garbage collection in the middle of the consumer's next read.
        reader.close()


def write_part_batches(dsn_kwargs: dict[str, Any], spec: PipelineSpec, target_schema: str, gid: str,
                       batches: Iterable[Any], conn: Any = None) -> dict[str, Any]:
    """Writes Arrow batches of records (``kafka_ranges.message_batch``) as one prepared part
    named ``gid``; returns ``part_result``. ``conn``: a connection of the caller's to write on
    and leave open, ready for its next part (None: one of its own, closed after)."""
    row_target = next((t for t in spec.targets if isinstance(t, RowTarget)), None)
    deltas = aggregate_deltas.empty(aggregate_targets(spec))
    counts = {"rows": 0}
    return _write(dsn_kwargs, spec, target_schema, gid, row_target, deltas, counts,
                  part_chunks(batches, spec, row_target, deltas, counts), conn)


def _write(dsn_kwargs: dict[str, Any], spec: PipelineSpec, target_schema: str, gid: str,
           row_target: RowTarget | None, deltas: aggregate_deltas.Deltas, counts: dict[str, int],
           chunks: Iterator[memoryview], given: Any = None) -> dict[str, Any]:
    if row_target is None:  # aggregates only: the deltas are the whole part, nothing to prepare
        try:
            for _ in chunks:
                pass
        except PartRefused as exc:
            return part_result(None, counts["rows"], refused=str(exc))
        return part_result(None, counts["rows"], deltas)
    conn = given if given is not None else psycopg2.connect(**{**dsn_kwargs, "application_name": "eos-part"})
    try:
        conn.tpc_begin(gid)
        table = sql.SQL("{}.{}").format(sql.Identifier(target_schema), sql.Identifier(row_target.table))
        try:
            with conn.cursor() as cur:
                copy_from_chunks(cur, table, [*SOURCE_COLUMNS, *row_target.columns], chunks)
            conn.tpc_prepare()  # durable from here on: only a decision commits it
        except PartRefused as exc:
            conn.tpc_rollback()
            return part_result(None, counts["rows"], refused=str(exc))
        except psycopg2.Error as exc:
            if not conn.closed:
                conn.tpc_rollback()
            return part_result(None, counts["rows"], refused=f"the database refused the part: {errors.tagged(exc)}")
    finally:
        if given is None:
            conn.close()
    if given is not None:
        # psycopg2 takes no statement after tpc_prepare until reset: the part stays prepared in
        # the database, for the decision and the committer, and the session is free again.
        conn.reset()
    return part_result(gid, counts["rows"], deltas)


def part_writer(dsn_kwargs: dict[str, Any], spec_source: SpecSource, target_schema: str, prefix: str,
                kafka_settings: dict[str, Any]) -> Callable[[int, Iterable[kafka_ranges.OffsetRange]], Iterator[dict]]:
    """Returns the function each Spark task runs (``mapPartitionsWithIndex``) on its share of
    a batch's offset ranges: it writes them as the part ``<prefix><task>:<attempt id>`` and
    yields its ``part_result``. It captures only plain values, so it pickles to any executor; the
    spec is built from ``spec_source`` once per executor process."""

    def write(index: int, ranges: Iterable[kafka_ranges.OffsetRange]) -> Iterator[dict[str, Any]]:
        from pyspark import TaskContext

        share = list(ranges)
        if not share:
            yield part_result(None, 0)
            return  # an empty task opens no connection
        context = TaskContext.get()
        attempt = context.taskAttemptId() if context is not None else 0
        started = time.perf_counter()
        spec = spec_source.load()
        collector.tune()  # once per Python worker, after its spec
        consumer = kafka_ranges.worker_consumer(kafka_settings)
        try:
            result = write_part(dsn_kwargs, spec, target_schema, f"{prefix}{index}:{attempt}",
                                consumer, share)
            # The task's own time: the write job's wall time less this is Spark's scheduling.
            yield {**result, "ms": round((time.perf_counter() - started) * 1000)}
        except BaseException:
            kafka_ranges.drop_worker_consumer(kafka_settings)  # a failed read may leave it mid-fetch
            raise

    return write


def driver_part_writer(dsn_kwargs: dict[str, Any], spec: PipelineSpec, target_schema: str,
                       kafka_settings: dict[str, Any]) -> Callable[[str, list[kafka_ranges.OffsetRange]], list[dict]]:
    """Writes a whole batch as one part in this process, the driver, as the Spark-less replay
    does (one task, P1-P6): a small batch then costs no Spark job, whose scheduling is most of
    a small batch's write (``python -m bench.latency``). The part is ``<prefix>driver:0``; a batch is
    written by the driver or by its tasks, never both. Returns ``[part_result]``."""

    def write(prefix: str, ranges: list[kafka_ranges.OffsetRange]) -> list[dict[str, Any]]:
        started = time.perf_counter()
        consumer = kafka_ranges.worker_consumer(kafka_settings)
        try:
            result = write_part(dsn_kwargs, spec, target_schema, f"{prefix}driver:0", consumer, ranges)
        except BaseException:
            kafka_ranges.drop_worker_consumer(kafka_settings)  # a failed read may leave it mid-fetch
            raise
        return [{**result, "ms": round((time.perf_counter() - started) * 1000)}]

    return write

