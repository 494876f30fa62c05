"""Declarative mirror definitions (spark_apps/eos_stream/cdc/definition.py)."""

from __future__ import annotations

import re

import pytest
import yaml

from spark_apps.eos_stream.cdc.definition import TablePattern, parse_mirror, target_from_schema
from spark_apps.eos_stream.cdc.mirror import MirrorError
from spark_apps.eos_stream.cdc.values import FieldSchema

YAML = """
mirror:
  topic_prefix: app
  tables:
    - source: public.customers
      key: [id]
      columns: {id: bigint, name: text, balance: "numeric(20,6)", notes: text, tags: "text[]"}
    - source: public.order_lines
      target: lines
      key: [order_id, line_no]
      columns: {order_id: bigint, line_no: integer, qty: integer, price: "numeric(12,2)"}
    - source_pattern: inventory.*
      target: inv_{table}
      columns: {sku: text}
  aggregates:
    - source: public.order_lines
      target: line_totals
      group_by: [order_id]
      sums: {qty_total: qty, value_total: price}
"""


def test_a_yaml_definition_parses_into_targets_routes_and_topics() -> None:
    definition = parse_mirror(yaml.safe_load(YAML)["mirror"])
    customers = definition.route("public.customers")
    lines = definition.route("public.order_lines")
    assert customers is not None and customers.table == "customers" and customers.key == ("id",)
    assert lines is not None and lines.table == "lines" and lines.key == ("order_id", "line_no")
    assert definition.route("public.unknown") is None
    assert definition.topics() == ["app.public.customers", "app.public.order_lines"]
    pattern = definition.topic_pattern()
    assert pattern is not None
    assert re.match(pattern, "app.inventory.stock") and not re.match(pattern, "app.public.stock")
    assert definition.aggregates[0].sums == {"qty_total": "qty", "value_total": "price"}


def test_twenty_tables_make_one_definition() -> None:
    tables = [{"source": f"public.t{i}", "key": ["id"], "columns": {"id": "bigint", "v": "text"}} for i in range(20)]
    definition = parse_mirror({"topic_prefix": "app", "tables": tables})
    assert len(definition.tables) == 20 and len(definition.topics()) == 20
    assert {definition.route(f"public.t{i}").table for i in range(20)} == {f"t{i}" for i in range(20)}  # type: ignore[union-attr]


@pytest.mark.parametrize(("data", "why"), [
    ({"tables": []}, r"mirror\.topic_prefix"),
    ({"topic_prefix": "app", "tables": []}, r"mirror\.tables: must list"),
    ({"topic_prefix": "app", "tables": [{"source": "customers", "key": ["id"], "columns": {"id": "bigint"}}]},
     r"tables\[0\]\.source: must name a source table as schema\.table"),
    ({"topic_prefix": "app", "tables": [{"source": "public.c", "key": [], "columns": {"id": "bigint"}}]},
     r"tables\[0\]\.key"),
    ({"topic_prefix": "app", "tables": [{"source": "public.c", "key": ["id"], "columns": {"id": "big int;"}}]},
     r"tables\[0\]\.columns.*not a PostgreSQL type"),
    ({"topic_prefix": "app", "tables": [{"source": "public.c", "key": ["id"], "columns": {"x": "text"}}]},
     r"tables\[0\].*not among its columns"),
    ({"topic_prefix": "app", "tables": [{"source": "public.c", "key": ["id"], "columns": {"id": "bigint"},
                                         "keys": ["id"]}]}, r"tables\[0\]\.keys: unknown key; did you mean 'key'\?"),
    ({"topic_prefix": "app", "tables": [{"source": "public.c", "key": ["id"], "columns": {"id": "bigint"}}],
      "aggregates": [{"source": "public.c", "group_by": ["id"]}]}, r"aggregates\[0\]\.target: must be a table name"),
    ({"topic_prefix": "app", "tables": [{"source": "public.c", "key": ["id"], "columns": {"id": "bigint"}}],
      "aggregates": {"source": "public.c"}}, r"mirror\.aggregates: must be a list of mappings"),
    ({"topic_prefix": "app", "tables": [{"source": "public.c", "key": ["id"], "columns": {"id": "bigint"}}],
      "aggregates": [{"source": "public.d", "target": "a", "group_by": ["id"]}]}, "not a mirrored table"),
    ({"topic_prefix": "app",
      "tables": [{"source": "public.c", "key": ["id"], "columns": {"id": "bigint", "f": "real"}}],
      "aggregates": [{"source": "public.c", "target": "a", "group_by": ["id"], "sums": {"s": "f"}}]}, "exact type"),
])
def test_errors_name_their_place(data: dict, why: str) -> None:
    with pytest.raises(MirrorError, match=why):
        parse_mirror(data)


def test_a_pattern_takes_keys_and_types_from_the_event_schema() -> None:
    pattern = TablePattern("inventory.*", "inv_{table}", {"sku": "text"})
    key = {"warehouse": FieldSchema("int32"), "sku": FieldSchema("string")}
    row = {"warehouse": FieldSchema("int32"), "sku": FieldSchema("string"), "qty": FieldSchema("int64"),
           "price": FieldSchema("string", None, {"__debezium.source.column.type": "NUMERIC",
                                                "__debezium.source.column.length": "12",
                                                "__debezium.source.column.scale": "2"}),
           "seen": FieldSchema("string", "io.debezium.time.ZonedTimestamp")}
    target = target_from_schema(pattern, "inventory.stock", key, row)
    assert (target.table, target.key) == ("inv_stock", ("warehouse", "sku"))
    assert dict(target.columns) == {"warehouse": "integer", "sku": "text", "qty": "bigint", "price": "numeric(12,2)",
                                    "seen": "timestamptz"}
    with pytest.raises(MirrorError, match=r"do not tell the types of columns \['note'\]"):
        target_from_schema(pattern, "inventory.stock", key, {**row, "note": FieldSchema("string")})
    with pytest.raises(MirrorError, match=r"schemas\.enable=true"):
        target_from_schema(pattern, "inventory.stock", None, None)
