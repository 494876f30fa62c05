"""The bookkeeping tables of a pipeline's meta schema, as the provider's queries name them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psycopg2 import sql

from spark_apps.eos_stream.state import meta_tables

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook


def table(hook: EosPostgresHook, name: str) -> sql.Composed:
    """``<meta_schema>.<name>``, quoted."""
    return meta_tables.table(hook.meta_schema, name)


def exists(cur: Any, hook: EosPostgresHook, name: str) -> bool:
    """Whether ``<meta_schema>.<name>`` exists (before a pipeline's first start it does not).

    :param cur: a dict cursor (``EosPostgresHook.cursor``)."""
    cur.execute("SELECT to_regclass(%s) IS NOT NULL AS present",
                (sql.SQL("{}.{}").format(sql.Identifier(hook.meta_schema), sql.Identifier(name)).as_string(cur),))
    return bool(cur.fetchone()["present"])


def ensure_meta_tables(hook: EosPostgresHook) -> None:
    """Creates the bookkeeping tables if missing (the app does the same at start)."""
    with hook.cursor() as cur:
        for statement in meta_tables.ddl_statements(hook.meta_schema):
            cur.execute(statement)
