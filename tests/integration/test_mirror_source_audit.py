"""The mirror audit on real PostgreSQL: a source schema in the source database and a mirror in
the target database, equal, then damaged one way at a time; each damage is found and counted,
and the CLI exits 1 on it (and 0 when equal)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg2 import sql

from spark_apps.eos_stream.audit.mirror_source import audit_against_source
from spark_apps.eos_stream.cdc.definition import parse_mirror
from tests.helpers.cdc_source import source_connection
from tests.streaming import pipeline_config

ROOT = Path(__file__).resolve().parents[2]
TABLES = [
    "CREATE TABLE {s}.customers (id bigint PRIMARY KEY, name text, balance numeric(20,6), at timestamptz,"
    " prefs jsonb, tags text[], photo bytea, born date)",
    "CREATE TABLE {s}.lines (order_id bigint, line_no int, sku text, qty int, price numeric(12,2),"
    " PRIMARY KEY (order_id, line_no))",
]
ROWS = [
    "INSERT INTO {s}.customers VALUES (1, 'ä', 1.5, '2026-01-01 12:00+09', '{{\"b\": [1, 2], \"a\": null}}',"
    " '{{x,\"y z\"}}', '\\x00ff', '2000-02-29'),"
    " (2, NULL, -0.000001, '2026-11-27 10:00:00.123456+00', NULL, NULL, NULL, NULL),"
    " (10, 'ten', 10, '1999-12-31 23:59:59-05', '{{}}', '{{}}', '', '1970-01-01')",
    "INSERT INTO {s}.lines VALUES (1, 1, 'a', 2, 1.10), (1, 2, 'a', 3, 2.20), (2, 1, NULL, 1, NULL),"
    " (2, 2, 'b', NULL, 5)",
]
SKU_TOTALS = ("CREATE TABLE {s}.sku_totals AS SELECT sku, count(*) AS row_count, COALESCE(sum(qty), 0) AS qty_total,"
              " COALESCE(sum(price), 0) AS amount FROM {s}.lines GROUP BY sku")


def definition(schema: str) -> dict[str, Any]:
    return {"topic_prefix": "shop", "tables": [
        {"source": f"{schema}.customers", "key": ["id"],
         "columns": {"id": "bigint", "name": "text", "balance": "numeric(20,6)", "at": "timestamptz",
                     "prefs": "jsonb", "tags": "text[]", "photo": "bytea", "born": "date"}},
        {"source": f"{schema}.lines", "key": ["order_id", "line_no"],
         "columns": {"order_id": "bigint", "line_no": "integer", "sku": "text", "qty": "integer",
                     "price": "numeric(12,2)"}}],
        "aggregates": [{"source": f"{schema}.lines", "target": "sku_totals", "group_by": ["sku"],
                        "sums": {"qty_total": "qty", "amount": "price"}}]}


@pytest.fixture
def sides(stack: dict[str, str], pg_conn: Any, unique_name: str) -> Iterator[tuple[Any, Any, str]]:
    """The same tables and rows in a source schema and a target schema (what a right mirror holds)."""
    source, schema = source_connection(stack), f"audit_{unique_name}"
    for conn in (source, pg_conn):
        with conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            for statement in TABLES + ROWS:
                cur.execute(statement.format(s=schema))
    with pg_conn.cursor() as cur:
        cur.execute(SKU_TOTALS.format(s=schema))
        cur.execute(f"ALTER TABLE {schema}.customers ADD COLUMN kept_after_drop text DEFAULT 'x'")
    try:
        yield source, pg_conn, schema
    finally:
        for conn in (source, pg_conn):
            conn.rollback()
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        source.close()


def audit(source: Any, target: Any, schema: str) -> dict[str, Any]:
    report = audit_against_source(source, target, parse_mirror(definition(schema)), schema)
    source.autocommit = target.autocommit = True
    return report


def damage(conn: Any, schema: str, statement: str) -> None:
    with conn.cursor() as cur:
        cur.execute(statement.format(s=schema))


def test_a_right_mirror_is_ok_and_each_damage_is_found(sides: tuple[Any, Any, str]) -> None:
    source, target, schema = sides
    report = audit(source, target, schema)
    assert report["ok"] and report["rows_that_differ"] == 0, json.dumps(report, default=str)
    assert [t["source_rows"] for t in report["tables"]] == [3, 4] and report["aggregates"][0]["source_rows"] == 3
    damage(target, schema, "UPDATE {s}.customers SET prefs = '{{\"a\": 1}}' WHERE id = 1")
    damage(target, schema, "DELETE FROM {s}.lines WHERE order_id = 2 AND line_no = 2")
    damage(target, schema, "INSERT INTO {s}.lines VALUES (3, 1, 'c', 1, 1)")
    damage(target, schema, "UPDATE {s}.sku_totals SET qty_total = qty_total + 1 WHERE sku IS NULL")
    report = audit(source, target, schema)
    customers, lines = report["tables"]
    assert (customers["differing"], customers["examples"]) == (1, {"differing": [["1"]]})
    assert (lines["missing"], lines["extra"]) == (1, 1)
    assert lines["examples"] == {"missing": [["2", "2"]], "extra": [["3", "1"]]}
    assert report["aggregates"][0]["differing"] == 1 and report["aggregates"][0]["examples"]["differing"] == [[None]]
    assert not report["ok"] and report["rows_that_differ"] == 4


def test_a_source_column_the_mirror_lacks_is_reported(sides: tuple[Any, Any, str]) -> None:
    source, target, schema = sides
    damage(source, schema, "ALTER TABLE {s}.customers ADD COLUMN added int")
    report = audit(source, target, schema)
    assert report["tables"][0]["missing_columns"] == ["added"] and not report["ok"]


def test_the_cli_exits_by_the_verdict_and_refuses_a_password(stack: dict[str, str], sides: tuple[Any, Any, str],
                                                             tmp_path: Path) -> None:
    _, target, schema = sides
    config = tmp_path / "pipeline.json"
    config.write_text(json.dumps(pipeline_config(stack, tmp_path, "audit_cli", topics=["shop.x"], target_schema=schema,
                                                 spec=None, mirror=definition(schema))))
    dsn = f"host={stack['EOS_PG_HOST']} port={stack['EOS_PG_PORT']} dbname={stack['EOS_SOURCE_PG_DB']} " \
          f"user={stack['EOS_PG_USER']}"
    env = {**os.environ, "PGPASSWORD": stack["EOS_PG_PASSWORD"], "EOS_PG_PASSWORD": stack["EOS_PG_PASSWORD"]}

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "spark_apps.eos_stream.audit.mirror_source",
                               "--config", str(config), *extra],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    done = run("--source", dsn)
    assert done.returncode == 0 and json.loads(done.stdout)["ok"], done.stderr[-2000:]
    damage(target, schema, "DELETE FROM {s}.customers WHERE id = 10")
    done = run("--source", dsn)
    assert done.returncode == 1 and json.loads(done.stdout)["tables"][0]["missing"] == 1, done.stderr[-2000:]
    refused = run("--source", dsn + " password=secret")
    assert refused.returncode == 2 and "PGPASSWORD" in refused.stderr
