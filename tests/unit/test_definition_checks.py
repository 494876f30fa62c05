"""Definition checks that one field's validator cannot make."""

from __future__ import annotations

import pytest

from airflow_provider_eos.utils.definition_checks import (
    definition_problems,
    load_spec,
    shared_places,
)
from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition, parse_definition
from airflow_provider_eos.utils.schedules import schedule_problem

LEDGER = "spark_apps.ledger.spec:LEDGER"


@pytest.mark.parametrize("good", [None, "@hourly", "@daily", "@quarterly", "@once", "@continuous", "*/5 * * * *",
                                  "0 3 * * MON-FRI"])
def test_schedules_airflow_takes(good) -> None:
    assert schedule_problem(good) is None


@pytest.mark.parametrize("bad", ["*/5 * * *", "@sometimes", "61 * * * *", "every 5 minutes", ""])
def test_schedules_airflow_refuses(bad) -> None:
    assert "is not a cron expression" in (schedule_problem(bad) or "")


def test_a_spec_that_does_not_load_says_why() -> None:
    assert load_spec(LEDGER).name == "ledger"
    with pytest.raises(ValueError, match=r"cannot import spec module 'no_such_team\.specs'"):
        load_spec("no_such_team.specs:ORDERS")
    with pytest.raises(ValueError, match=r"not a PipelineSpec \(it has no such attribute\); module "
                       r"'spark_apps\.ledger\.spec' defines the PipelineSpecs LEDGER, LEDGER_EVENTS_ONLY$"):
        load_spec("spark_apps.ledger.spec:NOPE")
    with pytest.raises(ValueError, match=r"not a PipelineSpec \(it is a str\)"):
        load_spec("spark_apps.ledger.spec:EVENTS_TABLE")


def _definition(name: str, **kw) -> PipelineDefinition:
    values = {"name": name, "topics": [f"{name}.events"], "spec": LEDGER, "target_schema": f"t_{name}",
              "meta_schema": f"m_{name}", "checkpoint_dir": f"s3a://b/ck/{name}"} | kw
    return parse_definition(values, source=f"{name}.yaml")


def test_only_the_newcomer_to_a_place_is_refused_naming_the_owner_and_the_fix() -> None:
    apart = {"a": _definition("a"), "b": _definition("b")}
    assert shared_places(apart) == {}
    same_table = {"a": _definition("a", target_schema="shop"), "b": _definition("b", target_schema="shop")}
    # The older (first in seniority) owns: here b, though a sorts first by name.
    problems = shared_places(same_table, ["b", "a"])
    assert problems == {"a": [
        "target tables shop.account_balances, shop.ledger_events belong to pipeline 'b' (its definition is the "
        "older); give this pipeline its own target_schema"]}
    same_meta = {"a": _definition("a", meta_schema="eos"), "b": _definition("b", meta_schema="eos")}
    assert shared_places(same_meta) == {"b": ["meta schema eos belongs to pipeline 'a' (its definition is the "
                                              "older); give this pipeline its own meta_schema"]}
    # A trailing slash names the same directory.
    same_dir = {"a": _definition("a", checkpoint_dir="/ck/x/"), "b": _definition("b", checkpoint_dir="/ck/x")}
    assert shared_places(same_dir, ["a", "b"])["b"] == [
        "checkpoint directory /ck/x belongs to pipeline 'a' (its definition is the older); "
        "give this pipeline its own checkpoint_dir"]
    # The same table names in different schemas are different tables.
    assert shared_places({"a": _definition("a"), "b": _definition("b", spec="spark_apps.ledger.spec:LEDGER")}) == {}


def test_definition_problems_gathers_spec_and_sharing() -> None:
    problems = definition_problems({"a": _definition("a", meta_schema="m"),
                                    "b": _definition("b", spec="no_such_team.specs:X", meta_schema="m")})
    assert "a" not in problems
    assert problems["b"][0].startswith("spec: cannot import spec module 'no_such_team.specs'")
    assert problems["b"][1].startswith("meta schema m belongs to pipeline 'a'")


def test_callbacks_must_import() -> None:
    problems = definition_problems({"a": _definition("a", airflow={
        "on_failure_callback": "acme_nowhere.alerts:page", "on_retry_callback": "json:dumps",
        "on_success_callback": "spark_apps.ledger.spec:EVENTS_TABLE"})})
    assert problems["a"][0].startswith("airflow.on_failure_callback: cannot import 'acme_nowhere.alerts:page'")
    assert problems["a"][1] == "airflow.on_success_callback: 'spark_apps.ledger.spec:EVENTS_TABLE' is not a " \
        "function (found str)"
    assert len(problems["a"]) == 2  # json:dumps is a function
