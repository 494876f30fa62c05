"""OpenLineage datasets and the audit's data-quality assertions (pure: no listener, no transport)."""

from __future__ import annotations

from airflow_provider_eos.utils.lineage import (
    audit_assertions,
    kafka_dataset_name,
    operator_lineage,
    postgres_dataset_name,
    topics_read,
)
from spark_apps.eos_stream.cdc.pipeline import mirror_spec
from spark_apps.ledger.spec import LEDGER

TARGET = {"host": "pg.example", "port": 6432, "dbname": "warehouse"}
EXACT = {"summary": {"duplicated": 0, "missing": 0, "wrongly_quarantined": 0},
         "aggregates": {"account_balances": {"keys_wrong": 0}}}


def test_names_follow_the_openlineage_conventions() -> None:
    assert kafka_dataset_name("k1:9092,k2:9092", "ledger.events") == ("kafka://k1:9092", "ledger.events")
    assert postgres_dataset_name(TARGET, "public", "ledger_events") == (
        "postgres://pg.example:6432", "warehouse.public.ledger_events")


def test_the_audit_becomes_assertions_per_table() -> None:
    assert audit_assertions(EXACT, "ledger_events", aggregate=False) == [
        {"assertion": "no_duplicates", "success": True, "expected": "0", "actual": "0"},
        {"assertion": "no_missing", "success": True, "expected": "0", "actual": "0"},
        {"assertion": "no_valid_record_quarantined", "success": True, "expected": "0", "actual": "0"},
    ]
    wrong = {"summary": {"duplicated": 3, "missing": 0, "wrongly_quarantined": 1},
             "aggregates": {"account_balances": {"keys_wrong": 7}}}
    assert [(a["assertion"], a["success"], a["actual"]) for a in audit_assertions(wrong, "ledger_events", False)] == [
        ("no_duplicates", False, "3"), ("no_missing", True, "0"), ("no_valid_record_quarantined", False, "1")]
    assert [(a["assertion"], a["success"]) for a in audit_assertions(wrong, "account_balances", True)] == [
        ("aggregates_exact", False), ("no_valid_record_quarantined", False)]
    # An aggregate the audit could not verify is not reported as exact.
    unverified = {**EXACT, "aggregates": {"account_balances": {"keys_wrong": None}}}
    assert audit_assertions(unverified, "account_balances", True)[0]["success"] is False


def test_writers_output_the_tables_and_the_audit_reads_them_with_its_facet() -> None:
    targets = LEDGER  # ledger_events (rows), account_balances (aggregate)
    written = operator_lineage("k1:9092", ["ledger.events"], TARGET, "public", targets)
    assert [(d.namespace, d.name) for d in written.inputs] == [("kafka://k1:9092", "ledger.events")]
    assert [d.name for d in written.outputs] == ["warehouse.public.ledger_events", "warehouse.public.account_balances"]
    audited = operator_lineage("k1:9092", ["ledger.events"], TARGET, "public", targets, audit=EXACT, write=False)
    assert audited.outputs == [] and len(audited.inputs) == 3
    facet = audited.inputs[2].facets["dataQualityAssertions"]
    assert [(a.assertion, a.success) for a in facet.assertions] == [
        ("aggregates_exact", True), ("no_valid_record_quarantined", True)]


MIRROR = mirror_spec({"topic_prefix": "app", "tables": [
    {"source": "shop.customers", "key": ["id"], "columns": {"id": "bigint", "name": "text"}},
    {"source_pattern": "inventory.*"}]})


def test_a_mirror_outputs_its_tables_and_its_offsets_audit_asserts_nothing_about_rows() -> None:
    """A mirror's spec has no row targets: its tables come from its definition. Its audit compares
    offsets, not rows, so no row assertion is attached (it would read as a failed one)."""
    written = operator_lineage("k1:9092", ["app.shop.customers"], TARGET, "m", MIRROR)
    assert [d.name for d in written.outputs] == ["warehouse.m.customers"]
    audited = operator_lineage("k1:9092", ["app.shop.customers"], TARGET, "m", MIRROR, audit=EXACT, write=False)
    assert [d.name for d in audited.inputs][1:] == ["warehouse.m.customers"]
    assert "dataQualityAssertions" not in audited.inputs[1].facets


def test_a_subscription_regex_is_read_as_the_topics_it_matches_and_lineage_never_fails() -> None:
    asked: list[list[str]] = []

    def resolve(entries: list[str]) -> list[str]:
        asked.append(entries)
        return ["app.shop.customers", "app.inventory.bins"]

    assert topics_read(["app.shop.customers"], resolve) == ["app.shop.customers"] and asked == []  # names only
    assert topics_read(["app.shop.customers", r"app\.inventory\..+"], resolve) == [
        "app.shop.customers", "app.inventory.bins"]

    def unreachable(entries: list[str]) -> list[str]:
        raise RuntimeError("no broker")

    assert topics_read(["app.shop.customers", r"app\.inventory\..+"], unreachable) == ["app.shop.customers"]
