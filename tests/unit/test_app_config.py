"""Configuration parsing: clear errors, and secrets only from the environment."""

from __future__ import annotations

import json

import pytest

from spark_apps.eos_stream.records.spec import load_spec
from spark_apps.eos_stream.run.config import ConfigError, from_dict, parse_args
from spark_apps.eos_stream.run.preflight import delivery_mode
from spark_apps.ledger.spec import LEDGER, LEDGER_EVENTS_ONLY

# What every config names (the app has no example pipeline to default to).
REQUIRED = {"pipeline": "p", "topics": ["t"], "spec": "spark_apps.ledger.spec:LEDGER"}


def test_unknown_delivery_mode_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown delivery mode 'twice'.*exactly_once"):
        from_dict({**REQUIRED, "delivery": "twice"}).validate()


@pytest.mark.parametrize("switch", ["record_parsing", "write_path"])
def test_a_removed_switch_is_named_as_removed(switch: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{switch} was removed \(.+\): delete it$"):
        from_dict({**REQUIRED, switch: "python" if switch == "record_parsing" else "staged"})


def test_unknown_key_lists_known_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown config keys \['topicz'\]"):
        from_dict({"topicz": ["a"]})


def test_password_in_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="EOS_PG_PASSWORD"):
        from_dict({"postgres": {"password": "x"}})


def test_password_comes_from_env_and_never_shows(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("EOS_PG_PASSWORD", "s3cret-value")
    monkeypatch.setenv("EOS_KAFKA_OPTIONS_JSON", json.dumps({"sasl.password": "kafka-secret"}))
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**REQUIRED, "postgres": {"host": "db.internal"}}))
    config = parse_args(["--config", str(path), "--set", "max_offsets_per_trigger=10", "--set", "postgres.port=6432"])
    assert config.postgres.password == "s3cret-value"
    assert config.postgres.port == 6432 and config.max_offsets_per_trigger == 10
    assert config.kafka_options == {"sasl.password": "kafka-secret"}
    shown = json.dumps(config.redacted()) + repr(config) + config.to_json()
    assert "s3cret-value" not in shown and "kafka-secret" not in shown


def test_idempotent_is_refused_on_aggregates_but_fine_on_rows() -> None:
    config = from_dict({**REQUIRED, "delivery": "idempotent"}).validate()
    with pytest.raises(ConfigError, match="cannot protect aggregate targets \\['account_balances'\\]"):
        delivery_mode(config, LEDGER)
    assert delivery_mode(config, LEDGER_EVENTS_ONLY).upsert_rows


def test_spec_reference_errors() -> None:
    from spark_apps.eos_stream.records.spec import SpecError

    with pytest.raises(SpecError, match="must look like"):
        load_spec("spark_apps.ledger.spec")
    with pytest.raises(SpecError, match="cannot import"):
        load_spec("no_such_module:X")
    with pytest.raises(SpecError, match="is not a PipelineSpec"):
        load_spec("spark_apps.ledger.spec:EVENTS_TABLE")


def test_root_cause_digs_the_database_error_out_of_sparks_wrapping() -> None:
    from spark_apps.eos_stream.run.entry import root_cause

    wrapped = RuntimeError(
        "[STREAM_FAILED] Query [id = 1] terminated with exception: [FOREACH_BATCH_USER_FUNCTION_ERROR] ...\n"
        "Traceback (most recent call last):\n  File \"batch_sink.py\", line 9, in process\n"
        "psycopg2.errors.StringDataRightTruncation: value too long for type character varying(64)\n"
    )
    assert root_cause(wrapped) == "StringDataRightTruncation: value too long for type character varying(64)"
    assert root_cause(ValueError("plain message")) == "ValueError: plain message"


def test_root_cause_is_not_sparks_query_report() -> None:
    """Spark's StreamingQueryException ends with the query's report, whose lines look like errors."""
    from spark_apps.eos_stream.run.entry import root_cause

    failed = RuntimeError(
        "[STREAM_FAILED] Query [id = 1, runId = 2] terminated with exception: ...\n"
        "Traceback (most recent call last):\n"
        "spark_apps.eos_stream.sink.staging.StageCopyError: [EOS-SQLSTATE 22021] CharacterNotInRepertoire: bad\n"
        "\tat org.apache.spark.sql.execution.python.PythonRunner.handle(PythonRunner.scala:1)\n"
        "=== Streaming Query ===\n"
        "Identifier: eos-ledger [id = 1, runId = 2]\n"
        "Current Committed Offsets: {}\n"
    )
    assert root_cause(failed) == "StageCopyError: [EOS-SQLSTATE 22021] CharacterNotInRepertoire: bad"


def test_root_cause_is_the_error_not_postgresqls_context_lines() -> None:
    from spark_apps.eos_stream.run.entry import root_cause

    failed = RuntimeError(
        "Traceback (most recent call last):\n"
        "psycopg2.errors.UniqueViolation: duplicate key value violates unique constraint \"k\"\n"
        "DETAIL:  Key (id)=(1) already exists.\n"
        "CONTEXT:  COPY ledger_events, line 1\n"
        "HINT:  nothing\n"
    )
    assert root_cause(failed) == 'UniqueViolation: duplicate key value violates unique constraint "k"'


@pytest.mark.parametrize("name", ["ledger:eu", "", "a b", "x" * 101, "ledger;drop"])
def test_pipeline_names_that_could_collide_or_break_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="pipeline name"):
        from_dict({**REQUIRED, "pipeline": name}).validate()
    from_dict({**REQUIRED, "pipeline": "ledger-eu.v2_1"}).validate()


def test_a_config_without_a_pipeline_topics_or_spec_is_refused() -> None:
    for key in ("pipeline", "topics"):
        with pytest.raises(ConfigError, match=rf"missing config keys \['{key}'\]"):
            from_dict({k: v for k, v in REQUIRED.items() if k != key})
    # A spec or a mirror section: which one is the rule ``spec``'s to say.
    with pytest.raises(ConfigError, match=r"required: name the spec \(package.module:ATTRIBUTE\), or give a mirror"):
        from_dict({k: v for k, v in REQUIRED.items() if k != "spec"}).validate()


def test_driver_write_max_records_defaults_to_small_batches_and_is_never_negative() -> None:
    assert from_dict(dict(REQUIRED)).validate().driver_write_max_records == 5000  # larger: Spark tasks write
    assert from_dict({**REQUIRED, "driver_write_max_records": 0}).validate().driver_write_max_records == 0
    assert from_dict({**REQUIRED, "driver_write_max_records": 20_000}).validate().driver_write_max_records == 20_000
    with pytest.raises(ConfigError, match="driver_write_max_records must be 0 or more"):
        from_dict({**REQUIRED, "driver_write_max_records": -1}).validate()
