"""The bookkeeping tables the app keeps in the target database.

They live in one schema (``eos`` by default) beside the pipeline's targets, so a
snapshot of the database carries the data and its Kafka replay point together.
Airflow-side hooks and sensors read the same tables; this module is the one
place that names them.
"""

from __future__ import annotations

from psycopg2 import sql

from spark_apps.eos_stream.state.ddl import AddColumn

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
# The pipeline's epoch (fencing token, see ``fencing.py``). Operational state
# like CONTROL: never in a snapshot, so a restore can never move it backwards.
EPOCHS = "pipeline_epochs"
# Since when each partition's LSO has been stuck, per pipeline, kept by the
# health check across its runs (airflow_provider_eos.sensors.lso_lag). The app
# never touches it; operational state, not data: a snapshot need not carry it.
LSO_WATCH = "lso_watch"
# Prepared parts a committed batch decided (``sink.parts``), until each is committed.
# Operational state: a snapshot waits until its pipeline has none, and never carries it.
DECIDED_PARTS = "decided_parts"
# Offset ranges skipped on purpose (``eos offsets reset``): records Kafka no longer held when the
# pipeline's stored offsets were moved past them, with who did it and why. Written in the same
# transaction as the offset change; the audit reports them as an accepted gap, not as missing.
ACCEPTED_GAPS = "accepted_gaps"

# A mirror's change records held back until their source transaction is whole
# (``cdc/transactions_sql``): below the stored offsets, so data like the offsets, written in the
# batch's transaction and carried by every snapshot with them. Its columns after ``pipeline``
# are a mirror stage's (``cdc.mirror.STAGE_COLUMNS``).
HELD_CHANGES = "held_changes"

_SCHEMA_DDL = """CREATE SCHEMA IF NOT EXISTS {schema}"""
_EPOCHS_DDL = """CREATE TABLE IF NOT EXISTS {schema}.{epochs} (
        pipeline    text        PRIMARY KEY,
        epoch       bigint      NOT NULL,
        changed_by  text,
        reason      text,
        changed_at  timestamptz NOT NULL DEFAULT now())"""

_LSO_WATCH_DDL = """CREATE TABLE IF NOT EXISTS {schema}.{lso_watch} (
        pipeline        text        NOT NULL,
        topic           text        NOT NULL,
        partition       integer     NOT NULL,
        lso             bigint      NOT NULL,
        high_watermark  bigint      NOT NULL,
        stuck_since     timestamptz NOT NULL,
        last_seen       timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (pipeline, topic, partition))"""

_DDL = [
    _SCHEMA_DDL,
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
        sqlstate       text,
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
    _EPOCHS_DDL,
    """CREATE TABLE IF NOT EXISTS {schema}.{decided_parts} (
        pipeline    text        NOT NULL,
        gid         text        NOT NULL,
        batch_id    bigint      NOT NULL,
        decided_at  timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (pipeline, gid))""",
    """CREATE TABLE IF NOT EXISTS {schema}.{accepted_gaps} (
        id           bigserial   PRIMARY KEY,
        pipeline     text        NOT NULL,
        topic        text        NOT NULL,
        partition    integer     NOT NULL,
        from_offset  bigint      NOT NULL,
        to_offset    bigint      NOT NULL,
        log_start    bigint      NOT NULL,
        log_end      bigint      NOT NULL,
        reason       text        NOT NULL,
        accepted_by  text        NOT NULL,
        accepted_at  timestamptz NOT NULL DEFAULT now())""",
    """CREATE TABLE IF NOT EXISTS {schema}.{held_changes} (
        pipeline text NOT NULL, _topic text NOT NULL, _partition integer NOT NULL, _offset bigint NOT NULL,
        _key bytea, _value bytea, _error text, _target text, _op text, _keys text, _after text, _unchanged text,
        _before text, _shape text, _create text, _tx text, _collection text,
        held_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (pipeline, _topic, _partition, _offset))""",
]
# Columns added since the first release, for tables made by older versions:
# (table, column, type). Only the app adds them, at start, through ddl.run_ddl.
_UPGRADES = [
    (DEAD_LETTERS, "sqlstate", "text"),
]


def _names(schema: str) -> dict[str, sql.Identifier]:
    return {
        "schema": sql.Identifier(schema),
        "offsets": sql.Identifier(OFFSETS),
        "attempts": sql.Identifier(BATCH_ATTEMPTS),
        "dead_letters": sql.Identifier(DEAD_LETTERS),
        "progress": sql.Identifier(PROGRESS),
        "control": sql.Identifier(CONTROL),
        "epochs": sql.Identifier(EPOCHS),
        "lso_watch": sql.Identifier(LSO_WATCH),
        "decided_parts": sql.Identifier(DECIDED_PARTS),
        "accepted_gaps": sql.Identifier(ACCEPTED_GAPS),
        "held_changes": sql.Identifier(HELD_CHANGES),
    }


def ddl_statements(schema: str = DEFAULT_SCHEMA) -> list[sql.Composed]:
    """CREATE statements for the bookkeeping tables, identifiers quoted."""
    return [sql.SQL(stmt).format(**_names(schema)) for stmt in _DDL]


def upgrade_statements(schema: str = DEFAULT_SCHEMA) -> list[AddColumn]:
    """Columns added since the first release, for bookkeeping tables made before them."""
    return [AddColumn(schema, table, column, type_) for table, column, type_ in _UPGRADES]


def epochs_ddl_statements(schema: str = DEFAULT_SCHEMA) -> list[sql.Composed]:
    """Just the schema and the epoch table: what a fence needs, without touching
    (and locking) the tables a running batch writes."""
    return [sql.SQL(stmt).format(**_names(schema)) for stmt in (_SCHEMA_DDL, _EPOCHS_DDL)]


def lso_watch_ddl_statements(schema: str = DEFAULT_SCHEMA) -> list[sql.Composed]:
    """The schema and the health check's stuck-LSO table, created by the provider when it
    first stores state (not in ``ddl_statements``: the app does not need it)."""
    return [sql.SQL(stmt).format(**_names(schema)) for stmt in (_SCHEMA_DDL, _LSO_WATCH_DDL)]


def table(schema: str, name: str) -> sql.Composed:
    """A schema-qualified, quoted table identifier."""
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))
