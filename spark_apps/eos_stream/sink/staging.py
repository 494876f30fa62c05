"""Per-batch staging tables, filled by the executors with COPY.

Each Spark task streams its Kafka partition into the staging table through
COPY, so memory is bounded by a COPY buffer, never by the batch, and nothing
is collected onto the driver.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg2
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream.records import staging_columns, staging_lines
from spark_apps.eos_stream.spec import PipelineSpec, load_spec

_PG_COLUMN_TYPES = {"_topic": "text", "_partition": "integer", "_offset": "bigint", "_key": "bytea",
                    "_value": "bytea", "_error": "text"}


def stage_prefix(pipeline: str) -> str:
    # Deterministic per pipeline, so a restarted app finds and drops its own leftovers.
    return "stage_" + hashlib.sha256(pipeline.encode()).hexdigest()[:12] + "_"


def create_stage(conn: PgConnection, spec: PipelineSpec, meta_schema: str, name: str) -> sql.Composed:
    """Creates an empty UNLOGGED staging table (no WAL: it is rebuilt on any retry)."""
    table = sql.SQL("{}.{}").format(sql.Identifier(meta_schema), sql.Identifier(name))
    types = {**_PG_COLUMN_TYPES, **{f.name: f.pg_type for f in spec.fields}}
    columns = sql.SQL(", ").join(
        sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(types[c])) for c in staging_columns(spec)
    )
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))
        cur.execute(sql.SQL("CREATE UNLOGGED TABLE {} ({})").format(table, columns))
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


class _LineStream:
    """A file-like view of an iterator of COPY lines, read in chunks by psycopg2."""

    def __init__(self, lines: Iterator[str]) -> None:
        self._lines = lines
        self._buffer = b""

    def read(self, size: int = 65536) -> bytes:
        size = size if size and size > 0 else 65536
        chunks = [self._buffer]
        filled = len(self._buffer)
        for line in self._lines:
            data = line.encode()
            chunks.append(data)
            filled += len(data)
            if filled >= size:
                break
        joined = b"".join(chunks)
        self._buffer = joined[size:]
        return joined[:size]

    readline = read


def partition_writer(
    dsn_kwargs: dict[str, Any], spec_ref: str, meta_schema: str, stage_name: str, keep_raw: bool
):
    """Returns the function each Spark task runs on its Arrow batches of
    (topic, partition, offset, key, value).

    It captures only plain values, so it pickles to any executor."""

    def write(batches: Iterable[Any]) -> Iterator[Any]:
        """Runs under mapInArrow: Arrow batches cross from the JVM far cheaper
        than pickled rows. Yields one (rows staged) batch for the driver to sum."""
        import pyarrow as pa

        iterator = iter(batches)
        first = next(iterator, None)
        if first is None:
            yield pa.RecordBatch.from_pydict({"staged": pa.array([0], pa.int64())})
            return  # an empty task opens no connection
        spec = load_spec(spec_ref)
        columns = sql.SQL(", ").join(sql.Identifier(c) for c in staging_columns(spec))
        staged = 0

        def records():
            nonlocal staged
            for batch in itertools.chain([first], iterator):
                staged += batch.num_rows
                yield from zip(*(batch.column(i).to_pylist() for i in range(5)), strict=True)

        conn = psycopg2.connect(**{**dsn_kwargs, "application_name": "eos-stage"})
        try:
            with conn, conn.cursor() as cur:
                copy = sql.SQL("COPY {}.{} ({}) FROM STDIN").format(
                    sql.Identifier(meta_schema), sql.Identifier(stage_name), columns
                )
                cur.copy_expert(copy.as_string(cur), _LineStream(staging_lines(spec, records(), keep_raw)))
        finally:
            conn.close()
        yield pa.RecordBatch.from_pydict({"staged": pa.array([staged], pa.int64())})

    return write
