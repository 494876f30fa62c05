"""The direct write path: each row written once, straight into its target,
inside the batch transaction.

PostgreSQL has no transaction that several sessions share, so the rows reach
the targets through the driver's one connection:

* each Spark task parses its partition once and sends back, per Arrow batch,
  the COPY lines of each row target (``target_lines.TargetLines``), then its
  dead letters, its aggregate partials and its count of valid records;
* the driver reads the tasks' results one partition at a time
  (``toLocalIterator``, the next partition computed meanwhile: memory is
  bounded by a partition, never by the batch) and COPYs each run of chunks
  into its table;
* dead letters and partials (small: per key, not per record) go to UNLOGGED
  tables made inside the transaction, and the staged path's SQL applies them
  (``apply_sql``); the tables are dropped before COMMIT (or PREPARE).

Spark hands the driver exactly one successful attempt's result per partition,
so a retried or speculative task cannot deliver a row twice: this path needs
no dedupe. It does not skip records below the stored offsets: the writer takes
it only when no stored offset is above the batch's start (``BatchWriter``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from psycopg2 import sql

from spark_apps.eos_stream import target_lines
from spark_apps.eos_stream.sink import apply_sql
from spark_apps.eos_stream.sink.staging import arrow_records, copy_from_chunks, create_table, stage_column_types
from spark_apps.eos_stream.spec import SOURCE_COLUMNS, AggregateTarget, PipelineSpec, RowTarget, load_spec
from spark_apps.eos_stream.target_lines import Record, TargetLines

# What a chunk holds, besides a target's index: dead letters, or a task's count of valid records.
DEAD_LETTERS, VALID_RECORDS = -1, -2

# The Spark schema of a task's results: (what, how many records, COPY text).
RESULT_SCHEMA = "target int, records long, chunk binary"

Chunk = tuple[int, int, bytes]


def _chunk(what: int, lines: list[str]) -> Chunk:
    return what, len(lines), "".join(lines).encode()


def task_chunks(spec: PipelineSpec, batches: Iterable[Iterable[Record]]) -> Iterator[list[Chunk]]:
    """What one task sends the driver, one list per batch of its records (in
    Kafka order): each row target's lines per batch, then, once the task's
    records are all in, its partials, its dead letters and its count of valid
    records (always last)."""
    lines = TargetLines(spec)
    for records in batches:
        chunks = [_chunk(i, out) for i, out in lines.add(records).items() if out]
        if chunks:
            yield chunks
    tail = [_chunk(i, out) for i, out in lines.partial_lines().items() if out]
    if lines.dead_letters:
        tail.append(_chunk(DEAD_LETTERS, lines.dead_letters))
    yield [*tail, (VALID_RECORDS, lines.valid, b"")]


def task_writer(spec_ref: str):
    """Returns the function each Spark task runs under mapInArrow on its
    (topic, partition, offset, key, value) Arrow batches: ``task_chunks`` as
    Arrow batches of ``RESULT_SCHEMA``. It captures only a string, so it
    pickles to any executor."""

    def encode(batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa

        for chunks in task_chunks(load_spec(spec_ref), map(arrow_records, batches)):
            targets, records, texts = zip(*chunks, strict=True)
            yield pa.RecordBatch.from_pydict({"target": pa.array(targets, pa.int32()),
                                              "records": pa.array(records, pa.int64()),
                                              "chunk": pa.array(texts, pa.binary())})

    return encode


@dataclass
class Written:
    applied: int
    dead_lettered: int
    timings_ms: dict[str, int]


class DirectRows:
    """Writes a batch's chunks on the batch transaction's cursor.

    :param spec: the pipeline's data.
    :param side_prefix: prefix of this batch's side tables (the pipeline's stage prefix).
    """

    def __init__(self, spec: PipelineSpec, target_schema: str, meta_schema: str, side_prefix: str) -> None:
        self.spec = spec
        self.target_schema = target_schema
        self.meta_schema = meta_schema
        self.side_prefix = side_prefix

    def write(self, cur, batch_id: int, chunks: Iterable[Chunk], pipeline: str) -> Written:
        started = time.perf_counter()
        side: dict[int, sql.Composed] = {}  # DEAD_LETTERS or an aggregate's index -> its table
        applied = dead = 0
        for what, run in itertools.groupby(chunks, key=lambda chunk: chunk[0]):
            if what == VALID_RECORDS:
                applied += sum(records for _, records, _ in run)
                continue
            counted = _Counted(run)
            table, columns = self._destination(cur, batch_id, what, side)
            copy_from_chunks(cur, table, columns, iter(counted))
            if what == DEAD_LETTERS:
                dead += counted.records
        streamed = time.perf_counter()
        if DEAD_LETTERS in side:
            cur.execute(apply_sql.dead_letters_statement(side[DEAD_LETTERS], self.meta_schema), {"pipeline": pipeline})
        for index, target in enumerate(self.spec.targets):  # in the spec's order, as the staged path
            if index in side and isinstance(target, AggregateTarget):
                cur.execute(apply_sql.aggregate_from_partials_statement(target, self.target_schema, side[index]))
        for table in side.values():
            cur.execute(sql.SQL("DROP TABLE {}").format(table))
        done = time.perf_counter()
        return Written(applied, dead, {"rows": round((streamed - started) * 1000),
                                       "apply": round((done - streamed) * 1000)})

    def _destination(self, cur, batch_id: int, what: int,
                     side: dict[int, sql.Composed]) -> tuple[sql.Composable, list[str]]:
        """The table and columns a run of chunks is COPYed into, creating a side table at its first use."""
        if what == DEAD_LETTERS:
            columns = stage_column_types(self.spec)
            name = f"{self.side_prefix}{batch_id}_dead"
        else:
            target = self.spec.targets[what]
            if isinstance(target, RowTarget):
                table = sql.SQL("{}.{}").format(sql.Identifier(self.target_schema), sql.Identifier(target.table))
                return table, [*SOURCE_COLUMNS, *target.columns]
            columns = target_lines.partial_columns(self.spec, target)
            name = f"{self.side_prefix}{batch_id}_partials_{what}"
        if what not in side:
            side[what] = create_table(cur, self.meta_schema, name, columns)
        return side[what], [c for c, _ in columns]


class _Counted:
    """The chunks of one run, counting their records as COPY reads them."""

    def __init__(self, run: Iterator[Chunk]) -> None:
        self._run = run
        self.records = 0

    def __iter__(self) -> Iterator[bytes]:
        for _, records, text in self._run:
            self.records += records
            yield text
