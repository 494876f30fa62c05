"""After a swap: the aside schema that holds the state a restore replaced, and its two ends,
finalize (drop it, once replay and audit passed) and rollback (put it back, when one failed).

The swap (``recovery.swap``) moves the replaced tables into ``<target_schema>_old_<time>`` and
records the restore in that schema's comment (``ASIDE_MARKER``: pipeline, snapshot, run, each
table and its schema, and the copies of tables the snapshot lacked). Only a schema with such a
name, whose record (if any) names this target, is ever dropped or moved back.

Failure transitions (steps 7 and 8 in ``recovery/__init__.py``): ``finalize_aside`` is one
``DROP SCHEMA``: before its commit the aside is intact, after it a rerun finds it gone.
``rollback_swap`` is one transaction (restored tables dropped, old tables moved back, the copies
put back, the epoch bumped, the record marked ``rolled_back_at``): before its commit nothing
changed, after it a rerun reads the mark and returns at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from airflow_provider_eos.recovery.catalog import DependentObjectsError, dependents, list_tables
from airflow_provider_eos.recovery.lock import swap_lock_key, target_lock_key

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.pg_tools import PgToolsHook


class AsideSchemaError(AirflowException):
    """The named aside schema is not one a restore of this target made, or holds no restore record."""


ASIDE_MARKER = "eos-restore"
_ASIDE_TIME = "%Y%m%dt%H%M%S"


def aside_schema_name(target_schema: str, at: datetime | None = None) -> str:
    """Where a swap moves the replaced tables: unique per second, so a kept one never blocks a rerun."""
    return f"{target_schema[:40]}_old_{(at or utc_now()).strftime(_ASIDE_TIME)}"


def aside_pattern(target_schema: str) -> re.Pattern[str]:
    """Exactly the names ``aside_schema_name`` makes for this target (group 1: the time)."""
    return re.compile(re.escape(target_schema[:40]) + r"_old_(\d{8}t\d{6})")


def aside_created(target_schema: str, name: str) -> datetime | None:
    """When a restore made this aside schema, or None when the name is not one of this target's."""
    match = aside_pattern(target_schema).fullmatch(name)
    if not match:
        return None
    return datetime.strptime(match.group(1), _ASIDE_TIME).replace(tzinfo=timezone.utc)


def aside_record(conn: PgConnection, aside: str) -> dict[str, Any] | None:
    """The restore record in an aside schema's comment: None when the schema does
    not exist, ``{}`` when it has no record (a schema of an older version)."""
    with conn.cursor() as cur:
        cur.execute("SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = %s", (aside,))
        row = cur.fetchone()
    if row is None:
        return None
    try:
        data = json.loads(row[0] or "")
    except ValueError:
        return {}
    return data if isinstance(data, dict) and data.get("marker") == ASIDE_MARKER else {}


def _own_aside(conn: PgConnection, aside: str, target_schema: str, pipeline: str) -> dict[str, Any] | None:
    """The aside's record, after checking it is one a restore of this target made
    (its name, and its record when it has one): nothing else is ever dropped."""
    if aside_created(target_schema, aside) is None:
        raise AsideSchemaError(f"{aside!r} is not an aside schema of a restore of {target_schema!r} "
                               f"(expected {target_schema[:40]}_old_<yyyymmddThhmmss>)")
    record = aside_record(conn, aside)
    if record and (record.get("target_schema"), record.get("pipeline")) != (target_schema, pipeline):
        raise AsideSchemaError(f"aside schema {aside!r} holds a restore of {record.get('target_schema')!r} "
                               f"pipeline {record.get('pipeline')!r}, not of {target_schema!r} {pipeline!r}")
    return record


def kept_aside_of_run(hook: PgToolsHook, target_schema: str, pipeline: str, run: str) -> str | None:
    """The aside schema an earlier restore of ``run`` kept and nobody rolled back or
    dropped yet (the oldest, should there be several): the state before that run."""
    conn = hook.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT nspname FROM pg_namespace WHERE starts_with(nspname, %s) ORDER BY 1",
                        (f"{target_schema[:40]}_old_",))
            names = [r[0] for r in cur.fetchall() if aside_created(target_schema, r[0])]
        for name in names:
            record = aside_record(conn, name) or {}
            if (record.get("run"), record.get("target_schema"), record.get("pipeline")) == (
                    run, target_schema, pipeline) and not record.get("rolled_back_at"):
                return name
        return None
    finally:
        conn.close()


def finalize_aside(hook: PgToolsHook, aside: str, target_schema: str, pipeline: str,
                   allow_dependents: bool = False) -> dict[str, Any]:
    """Drops a restore's aside schema (the old tables) once the recovery succeeded.

    Idempotent: a schema that is gone was finalized already.

    :raises DependentObjectsError: objects outside the aside schema depend on its
        tables (views or foreign keys left on the old tables by an
        ``allow_dependents`` restore); CASCADE would drop them. Set ``allow_dependents``.
    """
    conn = hook.connect()
    try:
        record = _own_aside(conn, aside, target_schema, pipeline)
        if record is None:
            return {"aside_schema": aside, "dropped": False, "reason": "does not exist (finalized already)"}
        found = dependents(conn, [(aside, t) for t in list_tables(conn, aside)])
        if found and not allow_dependents:
            raise DependentObjectsError(
                f"objects outside {aside!r} depend on its old tables: {', '.join(found)}; dropping it would "
                "drop them too (CASCADE). Recreate them on the restored tables, or set allow_dependents.")
        with conn.cursor() as cur:
            cur.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(hook.lock_timeout * 1000)}ms",))
            cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(aside)))
        conn.commit()
        return {"aside_schema": aside, "dropped": True, "dependents_dropped": found}
    finally:
        conn.close()


def sweep_asides(hook: PgToolsHook, target_schema: str, pipeline: str, older_than_days: float,
                 keep: Iterable[str] = ()) -> dict[str, list[str]]:
    """Drops this target's aside schemas older than ``older_than_days`` (by the time
    in their name). Only names ``aside_schema_name`` makes for this target, and
    whose record (if any) names this target; one with outside dependents is kept."""
    cutoff = utc_now().timestamp() - older_than_days * 86400
    swept: dict[str, list[str]] = {"dropped": [], "kept_with_dependents": []}
    conn = hook.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT nspname FROM pg_namespace WHERE starts_with(nspname, %s) ORDER BY 1",
                        (f"{target_schema[:40]}_old_",))
            names = [r[0] for r in cur.fetchall()]
        conn.rollback()
    finally:
        conn.close()
    for name in names:
        created = aside_created(target_schema, name)
        if name in set(keep) or created is None or created.timestamp() >= cutoff:
            continue
        try:
            result = finalize_aside(hook, name, target_schema, pipeline)
        except DependentObjectsError:
            swept["kept_with_dependents"].append(name)
            continue
        except AsideSchemaError:
            continue  # another target's schema with a name like ours
        if result["dropped"]:
            swept["dropped"].append(name)
    return swept


def rollback_swap(hook: PgToolsHook, aside: str, target_schema: str, pipeline: str, *,
                  lock_key: str | None = None, changed_by: str = "eos-rollback") -> dict[str, Any]:
    """Puts the state a restore replaced back, in ONE transaction.

    Under the swap lock and the pipeline's lock, with an epoch bump: the
    restored tables are dropped and the aside tables (the old state, with
    their owners, grants, indexes and sequences) moved back to the schemas
    the aside record names. The emptied aside schema stays, its record marked
    ``rolled_back_at``, so that a rerun knows it is done (finalize or the
    retention sweep drops it).

    :raises AsideSchemaError: the schema is gone (finalized: nothing to go back
        to), is not this target's, or has no restore record.
    """
    from spark_apps.eos_stream.state import fencing, meta_tables

    key = lock_key or target_lock_key(hook.dbname, target_schema, pipeline)
    conn = hook.connect()
    try:
        record = _rollback_record(conn, aside, target_schema, pipeline)
        if record.get("rolled_back_at"):
            return {"aside_schema": aside, "rolled_back": False,
                    "already_rolled_back_at": record["rolled_back_at"]}
        meta_schema = str(record["meta_schema"])
        with conn.cursor() as cur:
            cur.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(hook.lock_timeout * 1000)}ms",))
            cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (swap_lock_key(key),))
            fencing.lock_pipeline(cur, pipeline)
            for statement in meta_tables.epochs_ddl_statements(meta_schema):
                cur.execute(statement)
            cur.execute(fencing.bump_epoch_statement(meta_schema), {
                "pipeline": pipeline, "by": changed_by, "reason": f"rollback of restore {aside}"})
            epoch = int((cur.fetchone() or (0,))[0])
            kept = set(list_tables(conn, aside))
            tables = [(str(s), str(t)) for s, t in record["tables"]]
            cur.execute("SELECT s, t FROM unnest(%s::text[], %s::text[]) AS m(s, t)"
                        " WHERE to_regclass(format('%%I.%%I', s, t)) IS NOT NULL",
                        ([s for s, _ in tables], [t for _, t in tables]))
            restored = [(r[0], r[1]) for r in cur.fetchall()]
            if restored:
                # One statement, no CASCADE: foreign keys among them go together, anything
                # else built on the restored tables since makes the rollback fail, not vanish.
                cur.execute(sql.SQL("DROP TABLE {}").format(sql.SQL(", ").join(
                    sql.SQL("{}.{}").format(sql.Identifier(s), sql.Identifier(t)) for s, t in restored)))
            moved = _move_back(cur, aside, [(s, t) for s, t in tables if t in kept])
            refilled = _put_extras_back(cur, aside, record.get("extras") or [], kept)
            done = {**record, "rolled_back_at": utc_now().isoformat(), "rollback_epoch": epoch}
            cur.execute(sql.SQL("COMMENT ON SCHEMA {} IS {}").format(
                sql.Identifier(aside), sql.Literal(json.dumps(done))))
        conn.commit()
        return {"aside_schema": aside, "rolled_back": True, "epoch": epoch,
                "snapshot_id": record.get("snapshot_id"),
                "restored_dropped": [f"{s}.{t}" for s, t in restored], "moved_back": moved,
                "refilled": refilled, "left_in_aside": sorted(set(list_tables(conn, aside)))}
    finally:
        conn.close()


def _rollback_record(conn: Any, aside: str, target_schema: str, pipeline: str) -> dict[str, Any]:
    """The aside schema's restore record, which a rollback follows.

    :raises AsideSchemaError: the schema is gone, or has no record."""
    record = _own_aside(conn, aside, target_schema, pipeline)
    if record is None:
        raise AsideSchemaError(f"aside schema {aside!r} does not exist: the old state was dropped "
                               "(finalized or never kept); there is nothing to roll back to")
    if not record:
        raise AsideSchemaError(f"aside schema {aside!r} has no restore record (made by an older "
                               "version): move its tables back by hand")
    return record


def _move_back(cur: Any, aside: str, tables: list[tuple[str, str]]) -> list[str]:
    """Moves each kept table from the aside schema back to its own schema; returns them."""
    moved = []
    for schema, table in tables:
        cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        cur.execute(sql.SQL("ALTER TABLE {}.{} SET SCHEMA {}").format(
            sql.Identifier(aside), sql.Identifier(table), sql.Identifier(schema)))
        moved.append(f"{schema}.{table}")
    return moved


def _put_extras_back(cur: Any, aside: str, extras: list[Any], kept: set[str]) -> list[str]:
    """The rollback's part for tables the snapshot did not hold (the swap's ``extras``):
    each gets back exactly the rows its copy in the aside schema kept (TRUNCATE, no
    CASCADE, then the copy's rows; generated columns are computed again, identity
    values kept), so whatever the replay wrote into it is gone. A table that did not
    exist at the swap is dropped again (no CASCADE). Returns what it did, one line each."""
    done = []
    for schema, table, copy in extras:
        target = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))
        if not copy:
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(target))
            done.append(f"{schema}.{table}: dropped (it did not exist before the restore)")
            continue
        if copy not in kept:
            raise AsideSchemaError(f"the copy {aside}.{copy} of {schema}.{table} is missing from the aside "
                                   "schema: its rows from before the restore cannot be put back")
        cur.execute("SELECT to_regclass(%s)", (target.as_string(cur),))
        if (cur.fetchone() or (None,))[0] is None:
            # Dropped since the restore: the copy (rows only, no indexes) takes its place.
            cur.execute(sql.SQL("ALTER TABLE {}.{} SET SCHEMA {}").format(
                sql.Identifier(aside), sql.Identifier(copy), sql.Identifier(schema)))
            cur.execute(sql.SQL("ALTER TABLE {}.{} RENAME TO {}").format(
                sql.Identifier(schema), sql.Identifier(copy), sql.Identifier(table)))
            done.append(f"{schema}.{table}: recreated from its copy (it had been dropped)")
            continue
        cur.execute("SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0"
                    " AND NOT attisdropped AND attgenerated = '' ORDER BY attnum", (target.as_string(cur),))
        columns = sql.SQL(", ").join(sql.Identifier(r[0]) for r in cur.fetchall())
        cur.execute(sql.SQL("TRUNCATE {}").format(target))
        cur.execute(sql.SQL("INSERT INTO {} ({}) OVERRIDING SYSTEM VALUE SELECT {} FROM {}.{}").format(
            target, columns, columns, sql.Identifier(aside), sql.Identifier(copy)))
        rows = cur.rowcount
        cur.execute(sql.SQL("DROP TABLE {}.{}").format(sql.Identifier(aside), sql.Identifier(copy)))
        done.append(f"{schema}.{table}: {rows} rows back from before the restore")
    return done


def utc_now() -> datetime:
    return datetime.now(timezone.utc)
