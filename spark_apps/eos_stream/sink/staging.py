"""Per-batch staging tables, filled by the executors with COPY.

Each Spark task reads its Kafka offset range (``kafka_ranges``) and streams it
into the staging table through COPY, one Arrow batch of
``kafka_ranges.CHUNK_RECORDS`` records at a time, so memory is bounded by a
chunk, never by the micro-batch, and nothing is collected onto the driver. The
Spark-less replay stages its ranges the same way, in its own process.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg2
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream import collector, errors
from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.records import batch_lines
from spark_apps.eos_stream.records.columns import Columns
from spark_apps.eos_stream.records.parsing import staging_columns, staging_lines
from spark_apps.eos_stream.records.spec import PipelineSpec, SpecSource, StageCount

_PG_COLUMN_TYPES = {"_topic": "text", "_partition": "integer", "_offset": "bigint", "_key": "bytea",
                    "_value": "bytea", "_error": "text"}


def stage_prefix(pipeline: str) -> str:
    # Deterministic per pipeline, so a restarted app finds and drops its own leftovers.
    return "stage_" + hashlib.sha256(pipeline.encode()).hexdigest()[:12] + "_"


def stage_column_types(spec: PipelineSpec) -> list[tuple[str, str]]:
    """(name, PostgreSQL type) of a staging table's columns, in COPY order.

    Fields are staged as text, whatever their type: the apply statement casts
    them (``apply_sql``), in the driver's batch transaction, where the
    database's verdict on a value comes back with its SQLSTATE and can
    quarantine exactly that record. A typed stage would have the executors'
    COPY judge the values instead, and a refusal there fails a Spark task,
    whole, with no record to blame. A mirror stages its change records its own way."""
    if spec.mirror is not None:
        return spec.mirror.stage_column_types()
    types = {**_PG_COLUMN_TYPES, **{f.name: "text" for f in spec.fields}}
    return [(c, types[c]) for c in staging_columns(spec)]


def stage_table(meta_schema: str, name: str) -> sql.Composed:
    """A staging table's qualified name."""
    return sql.SQL("{}.{}").format(sql.Identifier(meta_schema), sql.Identifier(name))


def create_table(cur, meta_schema: str, name: str, columns: list[tuple[str, str]]) -> sql.Composed:
    """Creates an empty UNLOGGED table (no WAL: it is rebuilt on any retry) in
    the caller's transaction, replacing a leftover of the same name."""
    table = stage_table(meta_schema, name)
    definition = sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in columns)
    cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))
    cur.execute(sql.SQL("CREATE UNLOGGED TABLE {} ({})").format(table, definition))
    return table


def create_stage(conn: PgConnection, spec: PipelineSpec, meta_schema: str, name: str) -> sql.Composed:
    """Creates and commits an empty staging table, for the executors to fill."""
    with conn.cursor() as cur:
        table = create_table(cur, meta_schema, name, stage_column_types(spec))
    conn.commit()
    return table


def drop_stages(conn: PgConnection, meta_schema: str, pipeline: str, keep: str | None = None) -> int:
    """Drops this pipeline's staging tables (left behind by a crash)."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s AND starts_with(tablename, %s)",
            (meta_schema, stage_prefix(pipeline)),
        )
        names = [row[0] for row in cur.fetchall() if row[0] != keep]
        for name in names:
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}.{}").format(sql.Identifier(meta_schema), sql.Identifier(name)))
    conn.commit()
    return len(names)


class StageCopyError(RuntimeError):
    """A database error of a staging COPY, with its SQLSTATE tagged into the message."""


# Bytes psycopg2 asks for per read: one COPY message per read.
COPY_READ_SIZE = 1 << 20


class _ChunkReader:
    """A file-like view of an iterator of byte chunks, read by psycopg2's COPY.

    A read returns at most one chunk's rest, so a large chunk (an Arrow batch
    of encoded lines) is sent in slices without being copied whole again.
    ``source_error`` keeps what the iterator raised (see ``copy_from_chunks``)."""

    def __init__(self, chunks: Iterator[bytes | memoryview]) -> None:
        self._chunks = chunks
        self._current = memoryview(b"")
        self.source_error: Exception | None = None

    def read(self, size: int = COPY_READ_SIZE) -> bytes:
        size = size if size and size > 0 else COPY_READ_SIZE
        while not self._current:
            try:
                chunk = next(self._chunks, None)
            except Exception as exc:
                self.source_error = exc
                raise
            if chunk is None:
                return b""
            self._current = memoryview(chunk).cast("B")
        piece, self._current = self._current[:size], self._current[size:]
        return bytes(piece)

    readline = read


def copy_chunks(batches: Iterable[Any], spec: PipelineSpec, keep_raw: bool,
                counts: dict[str, Any]) -> Iterator[bytes | memoryview]:
    """The COPY data of a task's (topic, partition, offset, key, value) Arrow
    batches, one or two chunks per batch; counts the lines in ``counts["staged"]``, and
    a whole mirror's transaction groups in ``counts["groups"]`` (``MirrorApply.group_counter``).

    Without raw bytes (every batch but an isolated one) Arrow parses and encodes
    the records it can vouch for (``batch_lines``), Python the rest."""
    if spec.mirror is not None:
        counter = spec.mirror.group_counter()
        yield from spec.mirror.staging_chunks(_counted(batches, counts), keep_raw, counter)
        if counter is not None:  # the transaction topic's records counted, not staged
            counts["staged"] -= counter.unstaged
            counts["groups"] = counter.groups()
        return
    fast = not keep_raw and batch_lines.supported(spec)
    for batch in batches:
        counts["staged"] += batch.num_rows
        if fast:
            yield from batch_lines.batch_lines(batch, spec)
        else:
            yield "".join(staging_lines(spec, batch_lines.arrow_records(batch), keep_raw)).encode()


def _counted(batches: Iterable[Any], counts: dict[str, Any]) -> Iterator[Any]:
    for batch in batches:
        counts["staged"] += batch.num_rows
        yield batch


def reads_messages(spec: PipelineSpec) -> bool:
    """Whether ``spec`` stages from Kafka messages as they are (``kafka_ranges.MessageChunk``), not
    from Arrow batches: a mirror reads each record's bytes itself; the row pipelines' fast path is
    vectorised over Arrow."""
    return spec.mirror is not None


def stage_ranges(dsn_kwargs: dict[str, Any], spec: PipelineSpec, meta_schema: str, stage_name: str,
                 keep_raw: bool, consumer: Any, ranges: Iterable[kafka_ranges.OffsetRange]) -> StageCount:
    """Reads offset ranges with ``consumer``, all at once, and COPYs them into the stage in one
    transaction of its own; returns what it staged."""
    read = kafka_ranges.message_chunks if reads_messages(spec) else kafka_ranges.record_batches
    reader = read(consumer, ranges)
    try:
        return stage_batches(dsn_kwargs, spec, meta_schema, stage_name, keep_raw, reader)
    finally:
        reader.close()


def stage_batches(dsn_kwargs: dict[str, Any], spec: PipelineSpec, meta_schema: str, stage_name: str,
                  keep_raw: bool, batches: Iterable[Any], sessions: StageSessions | None = None) -> StageCount:
    """COPYs Arrow batches of (topic, partition, offset, key, value) into the stage in one
    transaction of its own, on a session of ``sessions`` or else a new one; returns what it
    staged: its lines, and a whole mirror's transaction groups (``copy_chunks``)."""
    counts: dict[str, Any] = {"staged": 0}
    chunks = copy_chunks(batches, spec, keep_raw, counts)
    if sessions is None:
        _copy(dsn_kwargs, spec, meta_schema, stage_name, chunks)
    else:
        sessions.copy(spec, meta_schema, stage_name, chunks)
    return StageCount(counts["staged"], counts.get("groups"))


class StageSessions:
    """The staging sessions of one process that stages batch after batch (the continuous
    engine): one per thread, kept from one batch to the next. A new session costs a backend
    start and authentication, often more than a small batch's COPY. A COPY that fails for any
    reason closes its session (it may have broken, or be mid-COPY); the next one opens another.

    :param open_session: opens a session (``sink.postgres.connect``)."""

    def __init__(self, open_session: Callable[[], PgConnection]) -> None:
        self._open = open_session
        self._local = threading.local()
        self._lock = threading.Lock()
        self._opened: list[PgConnection] = []

    def copy(self, spec: PipelineSpec, meta_schema: str, stage_name: str, chunks: Iterator[bytes | memoryview],
             after: Callable[[Any, sql.Composed], None] | None = None) -> None:
        """COPYs the chunks into the stage, committed when the last chunk is in, and after
        ``after(cursor, stage)`` if given."""
        conn = self._session()
        try:
            _copy_on(conn, spec, meta_schema, stage_name, chunks, after)
        except BaseException as exc:
            self._discard(conn)
            if isinstance(exc, psycopg2.Error):
                raise StageCopyError(errors.tagged(exc)) from exc
            raise

    def query(self, run: Callable[[Any], Any]) -> Any:
        """``run(cursor)``'s result, on this thread's session, in a transaction ended after it."""
        conn = self._session()
        try:
            with conn, conn.cursor() as cur:
                return run(cur)
        except BaseException:
            self._discard(conn)
            raise

    def _session(self) -> PgConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = self._local.conn = self._open()
            with self._lock:
                self._opened.append(conn)
        return conn

    def _discard(self, conn: PgConnection) -> None:
        self._local.conn = None
        with self._lock:
            self._opened.remove(conn)
        if not conn.closed:
            conn.close()

    def close(self) -> None:
        """Closes every thread's session; call it once no thread stages any more."""
        with self._lock:
            opened, self._opened = self._opened, []
        for conn in opened:
            if not conn.closed:
                conn.close()


def range_stager(dsn_kwargs: dict[str, Any], spec_source: SpecSource, meta_schema: str, stage_name: str,
                 keep_raw: bool, kafka_settings: dict[str, Any]
                 ) -> Callable[[Iterable[kafka_ranges.OffsetRange]], Iterator[StageCount]]:
    """Returns the function each Spark task runs on its share of the batch's offset ranges:
    it reads and stages them and yields its count, for the driver to merge (``StageCount.merged``).

    It captures only plain values, so it pickles to any executor; the spec is built from
    ``spec_source`` once per executor process."""

    def stage(ranges: Iterable[kafka_ranges.OffsetRange]) -> Iterator[StageCount]:
        share = list(ranges)
        if not share:
            yield StageCount(0, Columns())
            return  # an empty task opens no connection
        spec = spec_source.load()
        collector.tune()  # once per Python worker, after its spec
        consumer = kafka_ranges.worker_consumer(kafka_settings)
        try:
            yield stage_ranges(dsn_kwargs, spec, meta_schema, stage_name, keep_raw, consumer, share)
        except BaseException:
            kafka_ranges.drop_worker_consumer(kafka_settings)  # a failed read may leave it mid-fetch
            raise

    return stage


def worker_warmer(spec_source: SpecSource,
                  kafka_settings: dict[str, Any]) -> Callable[[int, Iterable[Any]], Iterator[int]]:
    """Returns what a warm-up task runs before the stream's first batch: it builds the spec
    and the Kafka consumer ``range_stager``'s tasks keep per Python worker, so the first batch
    does not wait for a worker's imports, its spec and its consumer's first connection."""

    def warm(_index: int, _items: Iterable[Any]) -> Iterator[int]:
        spec_source.load()
        consumer = kafka_ranges.worker_consumer(kafka_settings)
        consumer.list_topics(timeout=10)  # its bootstrap and metadata, which a first fetch waits for
        collector.tune()  # after the spec and the consumer: no full collection walks them again
        yield 0

    return warm


def copy_from_chunks(cur, table: sql.Composable, columns: Iterable[str], chunks: Iterator[bytes | memoryview]) -> None:
    """COPYs COPY-text chunks into ``table``'s ``columns`` on the caller's cursor.

    An error of the chunks' source (Kafka, a Spark task, a parser) is raised as
    itself: psycopg2 reports any failed ``read()`` as QueryCanceled (SQLSTATE
    57014), which ``errors.classify`` would take for a transient database error
    and retry, while the source's own error says what failed and how to class it."""
    copy = sql.SQL("COPY {} ({}) FROM STDIN").format(table, sql.SQL(", ").join(sql.Identifier(c) for c in columns))
    reader = _ChunkReader(chunks)
    try:
        cur.copy_expert(copy.as_string(cur), reader, size=COPY_READ_SIZE)
    except psycopg2.Error as exc:
        if reader.source_error is not None:
            raise reader.source_error from exc
        raise


def _copy_on(conn: PgConnection, spec: PipelineSpec, meta_schema: str, stage_name: str,
             chunks: Iterator[bytes | memoryview], after: Callable[[Any, sql.Composed], None] | None = None) -> None:
    """COPYs the chunks into the stage on ``conn``, then runs ``after(cursor, stage)`` if given;
    committed at the end."""
    stage = stage_table(meta_schema, stage_name)
    with conn, conn.cursor() as cur:
        copy_from_chunks(cur, stage, [c for c, _ in stage_column_types(spec)], chunks)
        if after is not None:
            after(cur, stage)


def _copy(dsn_kwargs: dict[str, Any], spec: PipelineSpec, meta_schema: str, stage_name: str,
          chunks: Iterator[bytes | memoryview]) -> None:
    """COPYs the chunks into the stage on a connection of its own, committed
    when the last chunk is in (before the caller reports its count)."""
    try:
        conn = psycopg2.connect(**{**dsn_kwargs, "application_name": "eos-stage"})
        try:
            _copy_on(conn, spec, meta_schema, stage_name, chunks)
        finally:
            conn.close()
    except psycopg2.Error as exc:
        # In a Spark task this reaches the driver only as text inside a job
        # failure: the tag carries the SQLSTATE there (errors.sqlstate_of).
        raise StageCopyError(errors.tagged(exc)) from exc
