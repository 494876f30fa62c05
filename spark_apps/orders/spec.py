"""Order lines: one row per line, and running sales per (sku, store).

Its shape differs from the ledger's on purpose: a two-column aggregate key, an
``integer`` column, and a value the producer never sends -- ``line_total_cents``
is computed by the spec's ``transform`` (quantity times unit price), which also
rejects a line that cannot be a sale (zero or negative quantity, negative price),
so that record is quarantined with its coordinates. ``sku_store_sales`` is not
idempotent either: a duplicated line shows in three of its columns.
"""

from __future__ import annotations

from typing import Any

from psycopg2 import sql

from spark_apps.eos_stream.records.spec import AggregateTarget, Field, PipelineSpec, RowTarget

LINES_TABLE = "order_lines"
SALES_TABLE = "sku_store_sales"
SKU_MAX = 32
BIGINT_MAX = 2**63 - 1


def orders_ddl(schema: str, unique_coordinates: bool = False) -> list[sql.Composed]:
    """CREATE statements for the orders targets (``unique_coordinates``: what idempotent delivery needs)."""
    names = {"schema": sql.Identifier(schema), "lines": sql.Identifier(LINES_TABLE),
             "sales": sql.Identifier(SALES_TABLE), "sku_max": sql.Literal(SKU_MAX)}
    statements = [
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {schema}").format(**names),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {schema}.{lines} ("
            " kafka_topic text NOT NULL, kafka_partition integer NOT NULL, kafka_offset bigint NOT NULL,"
            " order_id text NOT NULL, line_no integer NOT NULL, sku varchar({sku_max}) NOT NULL,"
            " store text NOT NULL, quantity integer NOT NULL, unit_price_cents bigint NOT NULL,"
            " line_total_cents bigint NOT NULL, ts timestamptz NOT NULL, seq bigint NOT NULL)"
        ).format(**names),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {schema}.{sales} ("
            " sku varchar({sku_max}) NOT NULL, store text NOT NULL, units bigint NOT NULL,"
            " revenue_cents bigint NOT NULL, lines bigint NOT NULL, PRIMARY KEY (sku, store))"
        ).format(**names),
    ]
    if unique_coordinates:
        statements.append(sql.SQL(
            "CREATE UNIQUE INDEX IF NOT EXISTS {index} ON {schema}.{lines} (kafka_topic, kafka_partition, kafka_offset)"
        ).format(index=sql.Identifier(f"{LINES_TABLE}_coordinates"), **names))
    return statements


def line_total(record: dict[str, Any]) -> dict[str, Any]:
    """Fills ``line_total_cents``; refuses a line that cannot be a sale."""
    if record["quantity"] <= 0:
        raise ValueError(f"quantity must be positive, got {record['quantity']}")
    if record["unit_price_cents"] < 0:
        raise ValueError(f"unit price must not be negative, got {record['unit_price_cents']}")
    total = record["quantity"] * record["unit_price_cents"]
    # The parser range-checks only the fields a producer sends. A total past bigint would
    # fail the COPY into staging on an executor, where no SQLSTATE reaches the poison
    # guard, so the batch could never pass: refuse the record here instead.
    if total > BIGINT_MAX:
        raise ValueError(f"line total {total} is out of range for bigint")
    return {**record, "line_total_cents": total}


_FIELDS = (
    Field("order_id", "text"),
    Field("line_no", "integer"),
    Field("sku", "text"),
    Field("store", "text"),
    Field("quantity", "integer"),
    Field("unit_price_cents", "bigint"),
    # Never sent by producers: the transform computes it.
    Field("line_total_cents", "bigint", required=False),
    Field("ts", "timestamptz"),
    Field("seq", "bigint"),
)

ORDERS = PipelineSpec(
    name="orders",
    fields=_FIELDS,
    targets=(
        RowTarget(LINES_TABLE, columns=tuple(f.name for f in _FIELDS)),
        AggregateTarget(
            SALES_TABLE,
            group_by=("sku", "store"),
            increments={"units": "quantity", "revenue_cents": "line_total_cents", "lines": None},
        ),
    ),
    transform=line_total,
    target_ddl=orders_ddl,
)
