"""The bookkeeping tables the app keeps in the target database.

They live in one schema (``eos`` by default) beside the pipeline's targets, so a
snapshot of the database carries the data and its Kafka replay point together.
Airflow-side hooks and sensors read the same tables; this module is the one
place that names them.
"""

from __future__ import annotations

from psycopg2 import sql

DEFAULT_SCHEMA = "eos"

# Next Kafka offset to apply per (pipeline, topic, partition). Written in the
# same transaction as the data: it is the pipeline's replay point.
OFFSETS = "kafka_offsets"
# Failed attempts per (pipeline, batch start offsets); written OUTSIDE the sink
# transaction so that a failure that rolls the batch back is still counted.
BATCH_ATTEMPTS = "batch_attempts"
# Quarantined records, with their Kafka coordinates. Never silently dropped.
DEAD_LETTERS = "dead_letters"
# One row per finished micro-batch (written by the StreamingQueryListener).
PROGRESS = "stream_progress"
# A row here asks a running pipeline to stop at the next batch boundary.
CONTROL = "stream_control"

_DDL = [
    """CREATE SCHEMA IF NOT EXISTS {schema}""",
    """CREATE TABLE IF NOT EXISTS {schema}.{offsets} (
        pipeline     text        NOT NULL,
        topic        text        NOT NULL,
        partition    integer     NOT NULL,
        next_offset  bigint      NOT NULL,
        batch_id     bigint,
        updated_at   timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (pipeline, topic, partition))""",
    """CREATE TABLE IF NOT EXISTS {schema}.{attempts} (
        pipeline     text        NOT NULL,
        batch_key    text        NOT NULL,
        attempts     integer     NOT NULL DEFAULT 0,
        last_error   text,
        updated_at   timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (pipeline, batch_key))""",
    """CREATE TABLE IF NOT EXISTS {schema}.{dead_letters} (
        id             bigserial   PRIMARY KEY,
        pipeline       text        NOT NULL,
        topic          text        NOT NULL,
        partition      integer     NOT NULL,
        "offset"       bigint      NOT NULL,
        key            bytea,
        value          bytea,
        error          text        NOT NULL,
        quarantined_at timestamptz NOT NULL DEFAULT now(),
        UNIQUE (pipeline, topic, partition, "offset"))""",
    """CREATE TABLE IF NOT EXISTS {schema}.{progress} (
        pipeline       text        NOT NULL,
        run_id         text        NOT NULL,
        batch_id       bigint      NOT NULL,
        input_rows     bigint      NOT NULL,
        start_offsets  jsonb,
        end_offsets    jsonb,
        durations_ms   jsonb,
        batch_duration_ms bigint,
        recorded_at    timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (pipeline, run_id, batch_id))""",
    """CREATE TABLE IF NOT EXISTS {schema}.{control} (
        pipeline          text PRIMARY KEY,
        stop_requested_at timestamptz,
        requested_by      text)""",
]


def ddl_statements(schema: str = DEFAULT_SCHEMA) -> list[sql.Composed]:
    """CREATE statements for the bookkeeping tables, identifiers quoted."""
    names = {
        "schema": sql.Identifier(schema),
        "offsets": sql.Identifier(OFFSETS),
        "attempts": sql.Identifier(BATCH_ATTEMPTS),
        "dead_letters": sql.Identifier(DEAD_LETTERS),
        "progress": sql.Identifier(PROGRESS),
        "control": sql.Identifier(CONTROL),
    }
    return [sql.SQL(stmt).format(**names) for stmt in _DDL]


def table(schema: str, name: str) -> sql.Composed:
    """A schema-qualified, quoted table identifier."""
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))
