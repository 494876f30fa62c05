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
    with pytest.raises(ValueError, match=r"not a PipelineSpec \(found NoneType\)"):
        load_spec("spark_apps.ledger.spec:NOPE")
    with pytest.raises(ValueError, match=r"not a PipelineSpec \(found str\)"):
        load_spec("spark_apps.ledger.spec:EVENTS_TABLE")


def _definition(name: str, **kw) -> PipelineDefinition:
    values = {"name": name, "topics": [f"{name}.events"], "spec": LEDGER, "target_schema": f"t_{name}",
              "meta_schema": f"m_{name}", "checkpoint_dir": f"s3a://b/ck/{name}"} | kw
    return parse_definition(values, source=f"{name}.yaml")


def test_pipelines_that_share_a_place_are_both_named() -> None:
    apart = {"a": _definition("a"), "b": _definition("b")}
    assert shared_places(apart) == {}
    same_table = {"a": _definition("a", target_schema="shop"), "b": _definition("b", target_schema="shop")}
    problems = shared_places(same_table)
    assert problems["a"] == ["target table shop.account_balances is also pipeline b's",
                             "target table shop.ledger_events is also pipeline b's"]
    assert problems["b"][0] == "target table shop.account_balances is also pipeline a's"
    same_meta = {"a": _definition("a", meta_schema="eos"), "b": _definition("b", meta_schema="eos")}
    assert shared_places(same_meta) == {"a": ["meta schema eos is also pipeline b's"],
                                        "b": ["meta schema eos is also pipeline a's"]}
    # A trailing slash names the same directory.
    same_dir = {"a": _definition("a", checkpoint_dir="/ck/x/"), "b": _definition("b", checkpoint_dir="/ck/x")}
    assert shared_places(same_dir)["b"] == ["checkpoint directory /ck/x is also pipeline a's"]
    # The same table names in different schemas are different tables.
    assert shared_places({"a": _definition("a"), "b": _definition("b", spec="spark_apps.ledger.spec:LEDGER")}) == {}


def test_definition_problems_gathers_spec_and_sharing() -> None:
    problems = definition_problems({"a": _definition("a", spec="no_such_team.specs:X", meta_schema="m"),
                                    "b": _definition("b", meta_schema="m")})
    assert problems["a"][0].startswith("spec: cannot import spec module 'no_such_team.specs'")
    assert problems["a"][1] == "meta schema m is also pipeline b's"
    assert problems["b"] == ["meta schema m is also pipeline a's"]


def test_callbacks_must_import() -> None:
    problems = definition_problems({"a": _definition("a", airflow={
        "on_failure_callback": "acme_nowhere.alerts:page", "on_retry_callback": "json:dumps",
        "on_success_callback": "spark_apps.ledger.spec:EVENTS_TABLE"})})
    assert problems["a"][0].startswith("airflow.on_failure_callback: cannot import 'acme_nowhere.alerts:page'")
    assert problems["a"][1] == "airflow.on_success_callback: 'spark_apps.ledger.spec:EVENTS_TABLE' is not a " \
        "function (found str)"
    assert len(problems["a"]) == 2  # json:dumps is a function
