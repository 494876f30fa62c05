"""One list of what a pipeline may not be (spark_apps/eos_stream/config_rules.py): every refusal the
app's start makes from its config alone is also made by ``eos validate``, in the same words."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_eos.cli import main as eos
from spark_apps.eos_stream.engines import spark as app
from spark_apps.eos_stream.run.config import ConfigError, from_dict
from spark_apps.eos_stream.run.config_rules import RULES, refusals, refuse
from spark_apps.ledger.spec import LEDGER_EVENTS_ONLY

LEDGER = "spark_apps.ledger.spec:LEDGER"
# A spec the app cannot create tables for: create_targets must be refused at once.
NO_DDL = dataclasses.replace(LEDGER_EVENTS_ONLY, target_ddl=None)

# A mirror pipeline's section (in place of its spec): refused in a mode without stored offsets.
MIRROR = {"spec": None, "mirror": {"topic_prefix": "app",
                                   "tables": [{"source": "public.t", "key": ["id"], "columns": {"id": "bigint"}}]}}
# A mirror that names tables by pattern: refused under the continuous engine.
PATTERN_MIRROR = {"spec": None, "mirror": {"topic_prefix": "app", "tables": [{"source_pattern": "inventory.*"}]}}
# A mirror of whole source transactions: refused unless its topics include app.transaction.
WHOLE_MIRROR = {"spec": None, "mirror": {
    "topic_prefix": "app", "transactions": "whole",
    "tables": [{"source": "public.t", "key": ["id"], "columns": {"id": "bigint"}}]}}
# Per rule: (the definition's keys that break it, the app config's keys that break it).
EXAMPLES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "pipeline": ({"name": "no spaces"}, {"pipeline": "no spaces"}),
    "topics": ({"topics": []}, {"topics": []}),
    "delivery": ({"delivery": "maybe"}, {"delivery": "maybe"}),
    "trigger": ({"stream": {"trigger": "always"}}, {"trigger": "always"}),
    "engine": ({"stream": {"engine": "continuous", "trigger": "availableNow"}},
               {"engine": "continuous", "trigger": "availableNow"}),
    "max_offsets_per_trigger": ({"stream": {"max_offsets_per_trigger": 0}}, {"max_offsets_per_trigger": 0}),
    "driver_write_max_records": ({"stream": {"driver_write_max_records": -1}}, {"driver_write_max_records": -1}),
    "continuous_linger_ms": ({"stream": {"continuous_linger_ms": -1}}, {"continuous_linger_ms": -1}),
    "continuous_max_bytes": ({"stream": {"continuous_max_bytes": 0}}, {"continuous_max_bytes": 0}),
    "max_batch_attempts": ({"stream": {"max_batch_attempts": 0}}, {"max_batch_attempts": 0}),
    "transient_retry_seconds": ({"stream": {"transient_retry_seconds": -1}}, {"transient_retry_seconds": -1}),
    "mirror_needs_stored_offsets": ({**MIRROR, "delivery": "at_least_once"},
                                    {**MIRROR, "delivery": "at_least_once"}),
    "spec": ({"spec": "spark_apps.ledger.spec:LEDGR"}, {"spec": "spark_apps.ledger.spec:LEDGR"}),
    "aggregates_need_exactly_once": ({"delivery": "idempotent"}, {"delivery": "idempotent"}),
    "create_targets_needs_ddl": ({"spec": f"{__name__}:NO_DDL", "stream": {"create_targets": True}},
                                 {"spec": f"{__name__}:NO_DDL", "create_targets": True}),
    "continuous_reads_listed_topics": ({**PATTERN_MIRROR, "stream": {"engine": "continuous"}},
                                       {**PATTERN_MIRROR, "engine": "continuous"}),
    "whole_transactions_read_their_topic": (WHOLE_MIRROR, WHOLE_MIRROR),
}


def _app_config(**change: Any) -> dict[str, Any]:
    return {"pipeline": "p", "topics": ["p.events"], "spec": LEDGER, "checkpoint_dir": "/ck/p", **change}


def _definition(**change: Any) -> dict[str, Any]:
    return {"name": "p", "topics": ["p.events"], "spec": LEDGER, "target_schema": "t_p", "meta_schema": "m_p",
            "checkpoint_dir": "/ck/p", **change}


def test_every_rule_has_an_example() -> None:
    # A rule added without an example here fails: the proof below covers the whole list.
    assert set(EXAMPLES) == {rule.name for rule in RULES}


@pytest.mark.parametrize("rule", sorted(EXAMPLES))
def test_what_the_app_refuses_eos_validate_refuses_in_the_same_words(rule: str, tmp_path: Path) -> None:
    definition_keys, app_keys = EXAMPLES[rule]
    found = refusals(from_dict(_app_config(**app_keys)))
    assert [r.rule for r in found] == [rule], found
    message = found[0].message
    # The app's start: a configuration error (exit 2), before Spark or any connection.
    config_file = tmp_path / "pipeline.json"
    config_file.write_text(json.dumps(_app_config(**app_keys)))
    started: list[Any] = []
    assert app.main(["--config", str(config_file)], run=started.append) == app.EXIT_CONFIG
    assert not started
    # eos validate, on the definition that yields that config.
    (tmp_path / "defs").mkdir()
    (tmp_path / "defs" / "p.yaml").write_text(json.dumps(_definition(**definition_keys)))
    out = io.StringIO()
    assert eos(["validate", str(tmp_path / "defs")], out=out) == 1
    assert out.getvalue().startswith("FAIL p.yaml: ") and message in out.getvalue(), out.getvalue()


def test_a_config_that_breaks_no_rule_starts() -> None:
    config = from_dict(_app_config())
    assert refusals(config) == [] and refuse(config) is config


def test_every_broken_rule_is_named_at_once() -> None:
    config = from_dict(_app_config(topics=[], max_batch_attempts=0))
    with pytest.raises(ConfigError, match=r"topics must be .*; max_batch_attempts must be at least 1$"):
        refuse(config)


def test_an_unknown_app_key_names_the_nearest() -> None:
    with pytest.raises(ConfigError, match=r"unknown config keys \['trigerr'\]; 'trigerr': did you mean 'trigger'\?"):
        from_dict(_app_config(trigerr="availableNow"))


def test_the_continuous_engine_takes_a_listed_mirror_and_spark_takes_a_pattern() -> None:
    # Only the pair is refused: a pattern under Spark, and listed tables under the continuous engine, run.
    assert refusals(from_dict(_app_config(**PATTERN_MIRROR, engine="spark"))) == []
    assert refusals(from_dict(_app_config(**MIRROR, engine="continuous"))) == []


@pytest.mark.parametrize(("change", "message"), [
    ({"spec": None}, "required: name the spec (package.module:ATTRIBUTE), or give a mirror section"),
    ({"mirror": MIRROR["mirror"]}, "either a spec or a mirror section, not both"),
])
def test_a_config_names_a_spec_or_a_mirror_section(change: dict[str, Any], message: str) -> None:
    found = refusals(from_dict(_app_config(**change)), load_spec=False)
    assert [r.rule for r in found] == ["spec"] and message in found[0].message, found
