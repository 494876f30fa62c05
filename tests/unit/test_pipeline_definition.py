"""The pipeline definition: one typed model, validated once, with errors that name the file and field."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from airflow_provider_eos.utils.definition_folder import find_definition, load_definitions
from airflow_provider_eos.utils.pipeline_definition import (
    PipelineDefinitionError,
    load_definition,
    parse_definition,
)

MINIMAL = {"name": "orders", "topics": ["orders.events"], "spec": "shop.specs:ORDERS",
           "checkpoint_dir": "s3a://bucket/orders"}


def _write(directory: Path, file_name: str, data: object) -> Path:
    path = directory / file_name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_a_minimal_definition_gets_the_defaults() -> None:
    d = parse_definition(MINIMAL, source="orders.yaml")
    assert (d.delivery, d.target_schema, d.meta_schema) == ("exactly_once", "public", "eos")
    assert d.stream.trigger == "processingTime" and d.stream.schedule is None
    assert d.snapshot.schedule == "@hourly" and d.health.hanging_after == 900
    assert d.connections.resolved({"kafka": "k", "postgres": "p", "spark": "s"}) == ("k", "p", "s")
    assert d.model_copy(update={"connections": d.connections.model_copy(update={"kafka": "mine"})}) \
        .connections.resolved({"kafka": "k", "postgres": "p", "spark": "s"}).kafka == "mine"


def test_yaml_file_with_every_section(tmp_path: Path) -> None:
    path = _write(tmp_path, "orders.yaml", """
name: orders
topics: [orders.events, orders.refunds]
spec: shop.specs.orders:ORDERS
delivery: two_phase
target_schema: orders
meta_schema: orders_eos
checkpoint_dir: /data/checkpoints/orders
connections: {kafka: kafka_orders}
stream: {trigger: availableNow, schedule: "*/10 * * * *", max_offsets_per_trigger: 50000}
snapshot: {schedule: null, keep_last: 3}
health: {stuck_after: 30, hanging_after: 600}
""")
    d = load_definition(path)
    assert d.delivery == "two_phase" and d.topics == ["orders.events", "orders.refunds"]
    assert d.stream.schedule == "*/10 * * * *" and d.snapshot.schedule is None and d.health.stuck_after == 30


@pytest.mark.parametrize(("change", "field"), [
    ({"name": "../etc"}, "name"),
    ({"name": ".hidden"}, "name"),
    ({"topics": []}, "topics"),
    ({"topics": ["a", "a"]}, "topics"),
    ({"spec": "no_attribute"}, "spec"),
    ({"delivery": "exactly_twice"}, "delivery"),
    ({"target_schema": "Public; DROP"}, "target_schema"),
    ({"stream": {"trigger": "always"}}, "stream.trigger"),
    ({"stream": {"max_offsets_per_trigger": 0}}, "stream.max_offsets_per_trigger"),
    ({"health": {"hanging_after": -1}}, "health.hanging_after"),
    ({"kafka_bootstrap": "host:9092"}, "kafka_bootstrap"),  # the connection's, never the definition's
    ({"postgres": {"password": "x"}}, "postgres"),
    ({"cdc": {"connectors": []}}, "cdc.connectors"),
    ({"cdc": {"connectors": ["a", "a"]}}, "cdc.connectors"),
    ({"cdc": {"connectors": ["a"], "replication_slots": ["Bad-Slot"], "source_postgres_conn_id": "s"}},
     "cdc.replication_slots"),
    ({"cdc": {"connectors": ["a"], "replication_slots": ["slot"]}}, "cdc"),  # no source connection
    ({"cdc": {"connectors": ["a"], "max_held_bytes": 0}}, "cdc.max_held_bytes"),
    ({"cdc": {"connectors": ["a"], "slots": ["x"]}}, "cdc.slots"),
])
def test_a_bad_field_is_named_in_the_error(change: dict, field: str) -> None:
    with pytest.raises(PipelineDefinitionError) as error:
        parse_definition({**MINIMAL, **change}, source="orders.yaml")
    assert str(error.value).startswith("orders.yaml: invalid pipeline definition") and f"{field}:" in str(error.value)


def test_files_that_cannot_be_a_definition(tmp_path: Path) -> None:
    with pytest.raises(PipelineDefinitionError, match="not valid YAML"):
        load_definition(_write(tmp_path, "orders.yaml", "name: [unclosed"))
    with pytest.raises(PipelineDefinitionError, match="a mapping, not list"):
        load_definition(_write(tmp_path, "orders.yml", "- orders"))
    with pytest.raises(PipelineDefinitionError, match=r"name the file orders\.json"):
        load_definition(_write(tmp_path, "other.json", MINIMAL))


def _own(name: str, **change: object) -> dict:
    """A loadable definition with places of its own (an importable spec, its own schemas)."""
    return {**MINIMAL, "name": name, "spec": "spark_apps.ledger.spec:LEDGER", "target_schema": f"t_{name}",
            "meta_schema": f"m_{name}", "checkpoint_dir": f"s3a://bucket/{name}", **change}


def test_one_bad_file_hides_no_other_pipeline(tmp_path: Path) -> None:
    _write(tmp_path, "orders.yaml", _own("orders"))
    _write(tmp_path, "ledger.json", _own("ledger"))
    _write(tmp_path, "broken.yaml", _own("broken", delivery="nope"))
    _write(tmp_path, "twice.yaml", _own("twice"))
    _write(tmp_path, "twice.json", _own("twice"))
    _write(tmp_path, ".hidden.yaml", "not: [valid")
    (tmp_path / "notes.txt").write_text("ignored")
    valid, errors = load_definitions(tmp_path)
    assert sorted(valid) == ["ledger", "orders"]
    assert sorted(errors) == ["broken.yaml", "twice.json", "twice.yaml"]
    assert "delivery" in errors["broken.yaml"] and "more than one definition" in errors["twice.yaml"]


def test_what_airflow_or_the_app_would_refuse_later_is_refused_at_parse_naming_the_file(tmp_path: Path) -> None:
    _write(tmp_path, "cron.yaml", _own("cron", health={"schedule": "*/5 * * *"}))
    _write(tmp_path, "nospec.yaml", _own("nospec", spec="acme_nowhere.specs:ORDERS"))
    _write(tmp_path, "a.yaml", _own("a", meta_schema="shared_eos"))
    _write(tmp_path, "b.yaml", _own("b", meta_schema="shared_eos"))
    _write(tmp_path, "c.yaml", _own("c", target_schema="t_d"))  # the same target tables as d
    _write(tmp_path, "d.yaml", _own("d"))
    _write(tmp_path, "fine.yaml", _own("fine", snapshot={"schedule": "@quarterly"}))
    valid, errors = load_definitions(tmp_path)
    # Of two that claim one place the older file keeps it (written first; by name in one second).
    assert sorted(valid) == ["a", "c", "fine"]
    assert errors["cron.yaml"].startswith(f"{tmp_path / 'cron.yaml'}: invalid pipeline definition: health.schedule")
    assert "is not a cron expression" in errors["cron.yaml"]
    assert "cannot import spec module 'acme_nowhere.specs'" in errors["nospec.yaml"]
    assert "meta schema shared_eos belongs to pipeline 'a'" in errors["b.yaml"]
    assert "target tables t_d.account_balances, t_d.ledger_events belong to pipeline 'c'" in errors["d.yaml"]
    assert "give this pipeline its own target_schema" in errors["d.yaml"]


def test_the_older_file_owns_a_place_whatever_the_names(tmp_path: Path) -> None:
    _write(tmp_path, "shipments.yaml", _own("shipments", target_schema="shop"))
    _write(tmp_path, "returns.yaml", _own("returns", target_schema="shop"))  # sorts first, added later
    old = time.time() - 3600
    os.utime(tmp_path / "shipments.yaml", (old, old))
    valid, errors = load_definitions(tmp_path)
    assert sorted(valid) == ["shipments"] and sorted(errors) == ["returns.yaml"]
    assert "target tables shop.account_balances, shop.ledger_events belong to pipeline 'shipments' (its " \
        "definition is the older); give this pipeline its own target_schema" in errors["returns.yaml"]


def test_find_definition_by_name(tmp_path: Path) -> None:
    _write(tmp_path, "orders.yaml", MINIMAL)
    assert find_definition(tmp_path, "orders").name == "orders"
    with pytest.raises(PipelineDefinitionError, match=r"no pipeline 'ledger'.*defined there: orders"):
        find_definition(tmp_path, "ledger")
    with pytest.raises(PipelineDefinitionError, match="invalid pipeline name"):
        find_definition(tmp_path, "../orders")
    with pytest.raises(PipelineDefinitionError, match="does not exist"):
        load_definitions(tmp_path / "missing")


def test_app_config_carries_the_definition_and_never_a_password() -> None:
    d = parse_definition({**MINIMAL, "stream": {"trigger": "availableNow", "max_batch_attempts": 5,
                                                "driver_write_max_records": 20_000}}, source="x")
    config = d.app_config(kafka_bootstrap="k:9092", postgres={"host": "pg", "port": 5432, "dbname": "d", "user": "u"},
                          run_seconds=30)
    assert config["pipeline"] == "orders" and config["kafka_bootstrap"] == "k:9092" and config["run_seconds"] == 30
    assert config["trigger"] == "availableNow" and config["max_batch_attempts"] == 5
    assert config["driver_write_max_records"] == 20_000
    from spark_apps.eos_stream.run.config import from_dict

    assert from_dict(config).validate().pipeline == "orders"  # the app accepts every key it gets
    with pytest.raises(PipelineDefinitionError, match="password"):
        d.app_config(kafka_bootstrap="k", postgres={"password": "secret"})


@pytest.mark.parametrize("switch", ["record_parsing", "write_path"])
def test_a_removed_switch_is_refused_by_name(switch: str) -> None:
    with pytest.raises(PipelineDefinitionError, match=rf"stream: .*{switch} was removed \(.+\): delete it"):
        parse_definition({**MINIMAL, "stream": {switch: "staged"}}, source="orders.yaml")


def test_a_cdc_section_names_its_source_and_an_unknown_key_its_neighbours() -> None:
    d = parse_definition({**MINIMAL, "cdc": {"connectors": ["shop-source"], "replication_slots": ["shop_orders"],
                                             "source_postgres_conn_id": "shop_source_db"}}, source="orders.yaml")
    assert d.cdc is not None and (d.cdc.kafka_connect_conn_id, d.cdc.max_held_bytes) == ("kafka_connect_default",
                                                                                           1024**3)
    assert d.cdc.max_held_age_seconds == 3600 and parse_definition(MINIMAL, source="orders.yaml").cdc is None
    with pytest.raises(PipelineDefinitionError, match="did you mean 'replication_slots'"):
        parse_definition({**MINIMAL, "cdc": {"connectors": ["a"], "replication_slot": ["x"]}}, source="orders.yaml")
