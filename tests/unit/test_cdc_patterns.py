"""Tables a mirror names by pattern (spark_apps/eos_stream/cdc/patterns.py), on the executors'
side: each record resolved to its target (a listed table's from the definition, a pattern
table's from the record's own schema), staged with what the driver needs to create the target,
or with a refusal naming the table and the fix; and the subscription that reads every topic
a pattern matches. The driver's side runs on the real PostgreSQL in
tests/integration/test_cdc_pattern_sink.py."""

from __future__ import annotations

import json
import re

import pytest

from spark_apps.eos_stream.cdc.definition import parse_mirror
from spark_apps.eos_stream.cdc.mirror import STAGE_COLUMNS, resolved_staging_lines
from spark_apps.eos_stream.cdc.patterns import Router
from spark_apps.eos_stream.cdc.pipeline import mirror_spec
from spark_apps.eos_stream.run.preflight import matching_topics
from tests.helpers.cdc_typed_records import typed_record, untyped_record

SECTION = {"topic_prefix": "app", "tables": [
    {"source": "public.customers", "key": ["id"], "columns": {"id": "bigint", "name": "text"}},
    {"source_pattern": "inventory.*", "target": "inv_{table}"}]}
STOCK_TYPES = {"warehouse": "INT4", "sku": "VARCHAR(40)", "qty": "INT8", "price": "NUMERIC(12,2)"}


def _cells(line: str) -> dict[str, str]:
    return dict(zip(STAGE_COLUMNS, line.rstrip("\n").split("\t"), strict=True))


def _stage(*records: tuple[bytes, bytes]) -> list[dict[str, str]]:
    router = Router(parse_mirror(SECTION))
    coordinates = [("t", 0, offset, key, value) for offset, (key, value) in enumerate(records)]
    return [_cells(line) for line in resolved_staging_lines(router.resolve, coordinates, keep_raw=False)]


def test_a_pattern_table_is_typed_by_its_schema_and_staged_with_its_target_definition() -> None:
    record = typed_record("inventory", "stock", "c", {"warehouse": 1, "sku": "a-1"},
                          {"warehouse": 1, "sku": "a-1", "qty": 5, "price": "9.50"}, STOCK_TYPES)
    (cells,) = _stage(record)
    assert (cells["_target"], cells["_op"], cells["_error"]) == ("inv_stock", "c", "\\N")
    assert json.loads(cells["_keys"]) == {"warehouse": "1", "sku": "a-1"}
    assert json.loads(cells["_create"]) == {
        "source": "inventory.stock", "table": "inv_stock", "key": ["warehouse", "sku"],
        "columns": {"warehouse": "integer", "sku": "character varying(40)", "qty": "bigint", "price": "numeric(12,2)"}}


def test_a_listed_table_needs_no_schema_and_stages_no_target_definition() -> None:
    (cells,) = _stage(untyped_record("public", "customers", {"id": 1}, {"id": 1, "name": "ann"}))
    assert (cells["_target"], cells["_error"], cells["_create"]) == ("customers", "\\N", "\\N")


def test_a_pattern_table_without_schemas_is_staged_as_a_refusal_naming_the_table_and_the_fix() -> None:
    (cells,) = _stage(untyped_record("inventory", "bins", {"id": 1}, {"id": 1}))
    assert (cells["_target"], cells["_error"], cells["_op"]) == ("inv_bins", "\\N", "\\N")
    refusal = json.loads(cells["_create"])
    assert refusal["source"] == "inventory.bins"
    assert "schemas.enable=true" in refusal["refused"] and "list the table under tables" in refusal["refused"]


def test_a_pattern_target_name_postgresql_would_cut_is_refused_naming_it() -> None:
    """Two such names sharing their first 63 bytes would land in one table: the batch is refused."""
    long_table = "stock_" + "x" * 60
    (cells,) = _stage(typed_record("inventory", long_table, "c", {"warehouse": 1}, {"warehouse": 1}, STOCK_TYPES))
    refusal = json.loads(cells["_create"])
    assert refusal["source"] == f"inventory.{long_table}"
    assert f"inv_{long_table}" in refusal["refused"] and "63-byte" in refusal["refused"]


def test_a_listed_target_name_postgresql_would_cut_is_refused_when_the_definition_loads() -> None:
    section = {"topic_prefix": "app", "tables": [
        {"source": "public.customers", "target": "c" * 64, "key": ["id"], "columns": {"id": "bigint"}}]}
    with pytest.raises(ValueError, match="63-byte"):
        parse_mirror(section)


def test_a_column_no_schema_types_is_refused_and_a_table_nothing_names_is_dead_lettered() -> None:
    untyped = typed_record("inventory", "stock", "c", {"warehouse": 1}, {"warehouse": 1, "note": "x"},
                           {"warehouse": "INT4", "note": "TEXT"})
    untyped = (untyped[0], untyped[1].replace(b'"__debezium.source.column.type": "TEXT"', b'"other": "x"'))
    stranger = untyped_record("sales", "orders", {"id": 1}, {"id": 1})
    refused, dead = _stage(untyped, stranger)
    assert "do not tell the types of columns ['note']" in json.loads(refused["_create"])["refused"]
    assert "no mirror target for source table 'sales.orders'" in dead["_error"]


def test_a_delete_of_a_pattern_table_carries_its_target_definition_too() -> None:
    record = typed_record("inventory", "stock", "d", {"warehouse": 1, "sku": "a"},
                          {"warehouse": 1, "sku": "a", "qty": 5, "price": "1"}, STOCK_TYPES)
    (cells,) = _stage(record)
    assert cells["_op"] == "d" and json.loads(cells["_create"])["key"] == ["warehouse", "sku"]


def test_the_subscription_reads_the_listed_topics_and_every_topic_a_pattern_matches() -> None:
    spec = mirror_spec(SECTION)
    pattern = spec.subscription(["app.public.customers"])
    assert pattern is not None
    topics = ["app.public.customers", "app.public.other", "app.inventory.stock", "app.inventory.bins",
              "appXinventory.stock", "other.inventory.stock", "app.inventory"]
    assert [t for t in topics if re.fullmatch(pattern, t)] == ["app.public.customers", "app.inventory.stock",
                                                             "app.inventory.bins"]
    assert matching_topics(topics, pattern, exclude=["app.public.customers"]) == ["app.inventory.bins",
                                                                                  "app.inventory.stock"]
    listed_only = mirror_spec({**SECTION, "tables": SECTION["tables"][:1]})
    assert listed_only.subscription(["app.public.customers"]) is None
    assert matching_topics(topics, None) == []


@pytest.mark.parametrize(("target", "expected"), [("{table}", "stock"), ("{schema}_{table}", "inventory_stock")])
def test_a_pattern_names_its_targets(target: str, expected: str) -> None:
    definition = parse_mirror({"topic_prefix": "app", "tables": [{"source_pattern": "inventory.*", "target": target}]})
    pattern = definition.pattern_for("inventory.stock")
    assert pattern is not None and pattern.target_name("inventory.stock") == expected
    assert definition.pattern_for("public.stock") is None


def test_the_sensors_hook_expands_a_subscription_regex_to_the_topics_it_matches_now() -> None:
    from spark_apps.eos_stream.kafka.metadata import expand_patterns

    pattern = mirror_spec(SECTION).subscription(["app.public.customers"])
    assert pattern is not None
    existing = ["app.inventory.stock", "app.public.customers", "app.inventory.bins", "app.public.other"]
    assert expand_patterns(["app.public.customers", pattern], existing) == [
        "app.public.customers", "app.inventory.bins", "app.inventory.stock"]
    assert expand_patterns(["app.public.customers", pattern], ["app.public.customers"]) == ["app.public.customers"]
    assert expand_patterns(["no.such.topic"], existing) == ["no.such.topic"]  # a name stays: missing is an error


def test_a_mirror_by_pattern_has_its_sensors_and_recovery_read_the_subscription() -> None:
    from types import SimpleNamespace

    from airflow_provider_eos.utils.subscription import subscribed_topics

    mirror = SimpleNamespace(topics=["app.public.customers"], spec=None, mirror=SECTION)
    topics = subscribed_topics(mirror)
    assert topics[0] == "app.public.customers" and len(topics) == 2 and re.fullmatch(topics[1], "app.inventory.x")
    assert subscribed_topics(SimpleNamespace(topics=["ledger.x"], spec="spark_apps.ledger.spec:LEDGER",
                                             mirror=None)) == ["ledger.x"]
