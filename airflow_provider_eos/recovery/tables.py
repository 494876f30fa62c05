"""Which tables a snapshot of a pipeline takes, and how the tables a snapshot holds differ
from the pipeline's now (a restore puts back only what it can)."""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.pg_tools import PgToolsHook
from airflow_provider_eos.recovery.catalog import list_tables
from airflow_provider_eos.recovery.lock import LOCK_TABLE


def snapshot_tables(hook: PgToolsHook, conn: Any, config: Any) -> tuple[list[tuple[str, str]], dict]:
    """The pipeline's target tables (from its spec, a mirror's tables and aggregates included;
    all must exist) and every
    bookkeeping table except staging leftovers and operational state: the
    control table (a restore must not undo a stop request), the epochs (a
    restore must never move an epoch back: a fenced driver would own the
    target again), the recovery locks and the health check's LSO watch (Kafka's state, not the
    data's: a restore must not make a hanging transaction look younger)."""
    from spark_apps.eos_stream.records.spec import spec_of
    from spark_apps.eos_stream.state import meta_tables

    spec = spec_of(config)
    present = set(list_tables(conn, config.target_schema))
    wanted = spec.target_tables()
    missing = [t for t in wanted if t not in present]
    if missing:
        raise AirflowException(
            f"pipeline {config.pipeline!r}: target tables {missing} do not exist in schema {config.target_schema!r} "
            f"of database {hook.dbname!r}"
        )
    meta = snapshot_meta_tables(hook, conn, config)
    if meta_tables.OFFSETS not in meta:
        raise AirflowException(f"pipeline {config.pipeline!r}: no {config.meta_schema}.{meta_tables.OFFSETS} table; "
                               "has the pipeline ever run in exactly_once mode?")
    tables = [(config.target_schema, t) for t in wanted] + [(config.meta_schema, t) for t in meta]
    roles = {(config.target_schema, t): "target" for t in wanted} | {(config.meta_schema, t): "meta" for t in meta}
    return tables, roles


def snapshot_meta_tables(hook: PgToolsHook, conn: Any, config: Any) -> list[str]:
    """The bookkeeping tables a snapshot takes: all in the meta schema but operational
    state (see ``snapshot_tables``) and staging leftovers."""
    from spark_apps.eos_stream.state import meta_tables

    excluded = {meta_tables.CONTROL, meta_tables.EPOCHS, meta_tables.LSO_WATCH, meta_tables.DECIDED_PARTS, LOCK_TABLE}
    return [t for t in list_tables(conn, config.meta_schema)
            if t not in excluded and not t.startswith("stage_")]  # staging leftovers


def table_changes(hook: PgToolsHook, conn: Any, config: Any, manifest: Any) -> dict[str, list[list[str]]]:
    """How the tables a snapshot taken now would hold differ from ``manifest``'s.

    Each a list of ``[schema, table]``. ``not_in_snapshot``: the spec's targets and the bookkeeping tables of today that
    the snapshot lacks (e.g. a target added to the spec after it was taken). A
    restore cannot put them back: they keep their rows while the offsets go back.
    ``not_in_spec``: target tables of the snapshot that the spec no longer writes
    (a restore would bring them back with the snapshot's rows). Both empty: the
    snapshot covers exactly what the pipeline has now."""
    from spark_apps.eos_stream.records.spec import spec_of

    wanted = [(config.target_schema, table) for table in spec_of(config).target_tables()]
    now = set(wanted) | {(config.meta_schema, t) for t in snapshot_meta_tables(hook, conn, config)}
    held = {(t.schema, t.table) for t in manifest.tables}
    return {"not_in_snapshot": [[s, t] for s, t in sorted(now - held)],
            "not_in_spec": sorted([t.schema, t.table] for t in manifest.tables
                                  if t.role == "target" and (t.schema, t.table) not in set(wanted))}
