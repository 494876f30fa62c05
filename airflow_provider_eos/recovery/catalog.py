"""What a recovery reads from the catalog of the target database: the stored offsets a snapshot's
transaction sees (its replay point), other pipelines sharing the meta schema (a restore would roll
them back), the database's identity (recorded in every manifest, compared by every restore) and
the objects that depend on the pipeline's tables (a swap would leave them on the old tables).
Functions of a connection, so each reads inside whatever transaction its caller holds."""

from __future__ import annotations

from collections.abc import Iterable

from airflow.sdk.exceptions import AirflowException
from psycopg2 import errors as pg_errors
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from airflow_provider_eos.recovery.checksums import TableRef
from spark_apps.eos_stream.kafka.offsets import Offsets


class DependentObjectsError(AirflowException):
    """Objects outside the pipeline's own tables depend on them: a swap would leave them behind."""

def list_tables(conn: PgConnection, schema: str) -> list[str]:
    """The ordinary and partitioned tables of ``schema`` (partitions left out), by name."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relkind IN ('r', 'p') AND NOT c.relispartition ORDER BY 1",
            (schema,),
        )
        return [r[0] for r in cur.fetchall()]


# Objects that depend (pg_depend) on the given tables or their row types and are
# not the tables' own indexes, constraints, owned sequences, toast tables,
# triggers, policies, rules, defaults, statistics or types. One row each:
# (name, kind). Binds %(schemas)s and %(tables)s (parallel text arrays).
DEPENDENTS_SQL = """
WITH t AS (
  SELECT c.oid, c.reltype FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  JOIN unnest(%(schemas)s::text[], %(tables)s::text[]) AS m(s, r) ON m.s = n.nspname AND m.r = c.relname
  WHERE c.relkind IN ('r', 'p')
), refs AS (
  SELECT 'pg_class'::regclass AS cls, oid FROM t UNION ALL SELECT 'pg_type'::regclass, reltype FROM t
), d AS (
  SELECT DISTINCT dep.classid, dep.objid FROM pg_depend dep JOIN refs ON dep.refclassid = refs.cls
  AND dep.refobjid = refs.oid WHERE dep.deptype <> 'p'
), described AS (
  SELECT CASE d.classid
    WHEN 'pg_rewrite'::regclass THEN (
      SELECT CASE WHEN r.ev_class IN (SELECT oid FROM t) THEN NULL ELSE ARRAY[r.ev_class::regclass::text,
        CASE c.relkind WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view' ELSE 'rule ' || r.rulename END] END
      FROM pg_rewrite r JOIN pg_class c ON c.oid = r.ev_class WHERE r.oid = d.objid)
    WHEN 'pg_constraint'::regclass THEN (
      SELECT CASE WHEN k.conrelid IN (SELECT oid FROM t) THEN NULL
        WHEN k.conrelid <> 0 THEN ARRAY[k.conrelid::regclass::text,
          CASE k.contype WHEN 'f' THEN 'foreign key ' ELSE 'constraint ' END || k.conname]
        ELSE ARRAY[k.contypid::regtype::text, 'domain constraint ' || k.conname] END
      FROM pg_constraint k WHERE k.oid = d.objid)
    WHEN 'pg_class'::regclass THEN (
      SELECT CASE WHEN c.oid IN (SELECT oid FROM t) OR c.relkind IN ('i', 'I', 't', 'S') THEN NULL
        ELSE ARRAY[c.oid::regclass::text, CASE c.relkind WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view'
          WHEN 'r' THEN 'table (inherits or partition)' WHEN 'p' THEN 'partitioned table' ELSE 'relation' END] END
      FROM pg_class c WHERE c.oid = d.objid)
    WHEN 'pg_type'::regclass THEN (
      SELECT CASE WHEN y.typrelid IN (SELECT oid FROM t) OR y.typelem IN (SELECT reltype FROM t) THEN NULL
        ELSE ARRAY[y.oid::regtype::text, 'type'] END FROM pg_type y WHERE y.oid = d.objid)
    WHEN 'pg_trigger'::regclass THEN (
      SELECT CASE WHEN g.tgrelid IN (SELECT oid FROM t) THEN NULL
        ELSE ARRAY[g.tgrelid::regclass::text, 'trigger ' || g.tgname] END FROM pg_trigger g WHERE g.oid = d.objid)
    WHEN 'pg_policy'::regclass THEN (
      SELECT CASE WHEN p.polrelid IN (SELECT oid FROM t) THEN NULL
        ELSE ARRAY[p.polrelid::regclass::text, 'policy ' || p.polname] END FROM pg_policy p WHERE p.oid = d.objid)
    WHEN 'pg_attrdef'::regclass THEN (
      SELECT CASE WHEN a.adrelid IN (SELECT oid FROM t) THEN NULL
        ELSE ARRAY[a.adrelid::regclass::text, 'column default'] END FROM pg_attrdef a WHERE a.oid = d.objid)
    WHEN 'pg_statistic_ext'::regclass THEN (
      SELECT CASE WHEN x.stxrelid IN (SELECT oid FROM t) THEN NULL
        ELSE ARRAY[x.stxrelid::regclass::text, 'statistics ' || x.stxname] END
      FROM pg_statistic_ext x WHERE x.oid = d.objid)
    WHEN 'pg_publication_rel'::regclass THEN (
      SELECT ARRAY[quote_ident(p.pubname), 'publication'] FROM pg_publication_rel pr
      JOIN pg_publication p ON p.oid = pr.prpubid WHERE pr.oid = d.objid)
    ELSE (SELECT ARRAY[coalesce(o.identity, '?'), coalesce(o.type, '?')]
          FROM pg_identify_object(d.classid, d.objid, 0) o)
  END AS what FROM d
)
SELECT DISTINCT what[1], what[2] FROM described WHERE what IS NOT NULL ORDER BY 1, 2
"""


def stored_offsets_in(conn: PgConnection, meta_schema: str, pipeline: str) -> Offsets:
    """The pipeline's stored offsets as ``conn``'s transaction sees them (a snapshot's replay point)."""
    from spark_apps.eos_stream.state import meta_tables

    with conn.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f'"{meta_schema}"."{meta_tables.OFFSETS}"',))
        row = cur.fetchone()
        if row is None or row[0] is None:
            return {}
        cur.execute(
            sql.SQL("SELECT topic, partition, next_offset FROM {} WHERE pipeline = %s ORDER BY 1, 2").format(
                meta_tables.table(meta_schema, meta_tables.OFFSETS)
            ),
            (pipeline,),
        )
        return {(topic, int(partition)): int(offset) for topic, partition, offset in cur.fetchall()}


def other_pipelines(conn: PgConnection, meta_schema: str, pipeline: str) -> list[str]:
    """Other pipelines with offsets in the same meta schema (a restore would roll them back)."""
    from spark_apps.eos_stream.state import meta_tables

    with conn.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f'"{meta_schema}"."{meta_tables.OFFSETS}"',))
        row = cur.fetchone()
        if row is None or row[0] is None:
            return []
        cur.execute(
            sql.SQL("SELECT DISTINCT pipeline FROM {} WHERE pipeline <> %s ORDER BY 1").format(
                meta_tables.table(meta_schema, meta_tables.OFFSETS)
            ),
            (pipeline,),
        )
        return [r[0] for r in cur.fetchall()]


def database_identity(conn: PgConnection) -> dict[str, str]:
    """Which database ``conn`` is on: its name and OID, and the cluster's
    ``system_identifier`` (set by initdb, kept by physical replicas and
    backups). Recorded in every manifest; a restore refuses a manifest whose
    identity is not the target's (``recovery.manifest.identity_problem``). A role
    that may not call ``pg_control_system()`` records no system identifier."""
    with conn.cursor() as cur:
        cur.execute("SELECT current_database(), oid::text FROM pg_database WHERE datname = current_database()")
        row = cur.fetchone()
        assert row is not None
        identity = {"database": str(row[0]), "database_oid": str(row[1])}
        cur.execute("SAVEPOINT eos_identity")
        try:
            cur.execute("SELECT system_identifier::text FROM pg_control_system()")
            found = cur.fetchone()
            if found and found[0]:
                identity["system_identifier"] = str(found[0])
            cur.execute("RELEASE SAVEPOINT eos_identity")
        except pg_errors.InsufficientPrivilege:
            cur.execute("ROLLBACK TO SAVEPOINT eos_identity")
    return identity


def dependents(conn: PgConnection, tables: Iterable[TableRef]) -> list[str]:
    """``schema.name (kind)`` of every object outside ``tables`` that depends on
    one of them (views, foreign keys from other tables, publications, ...)."""
    refs = list(tables)
    with conn.cursor() as cur:
        cur.execute(DEPENDENTS_SQL, {"schemas": [s for s, _ in refs], "tables": [t for _, t in refs]})
        return [f"{name} ({kind})" for name, kind in cur.fetchall()]
