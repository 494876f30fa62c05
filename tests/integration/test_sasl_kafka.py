"""Secured Kafka (SASL_PLAINTEXT + SCRAM-SHA-512 on the local broker's second listener),
spelled once in librdkafka's names, as a Kafka connection's extra holds them.

The app takes them from ``EOS_KAFKA_OPTIONS_JSON`` (never its command line), uses them as they
are for its own librdkafka clients (preflight, audit) and translated for Spark's Java source
(``spark_apps.eos_stream.kafka_security``). Every process's command line is read all along."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.helpers.cmdline import CmdlineWatch
from tests.streaming import audit, pipeline_config, run_app

pytestmark = pytest.mark.integration


def sasl_options(stack: dict[str, str], password: str | None = None) -> dict[str, str]:
    return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": stack["EOS_KAFKA_SASL_USER"],
            "sasl.password": password or Path(stack["EOS_KAFKA_SASL_PASSWORD_FILE"]).read_text().strip()}


def test_the_app_streams_exactly_once_through_sasl(stack: dict, tmp_path: Path, unique_name: str) -> None:
    options = sasl_options(stack)
    config = pipeline_config(stack, tmp_path, f"sasl{unique_name}", kafka_bootstrap=stack["EOS_KAFKA_SASL_BOOTSTRAP"])
    topic = config["topics"][0]
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=2)
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 3000, topic=topic, abort_every=3, batch_size=300, seed=5,
                   transactional_id=f"p{unique_name}")
    env = {"EOS_KAFKA_OPTIONS_JSON": json.dumps(options)}
    watch = CmdlineWatch({"kafka password": options["sasl.password"]})
    watch.start()
    try:
        run = run_app(config, tmp_path, env_extra=env, timeout=300)
        # The audit reads Kafka through the same listener with the same librdkafka options.
        report = audit(config, tmp_path, env_extra=env)
    finally:
        watch.stop()
    assert run.process.returncode == 0, run.log()[-3000:]
    assert report["ok"], report
    assert report["summary"]["committed_records"] == 3000, report["summary"]  # aborted batches come on top
    assert watch.seen > 0 and not watch.hits, watch.hits
    assert options["sasl.password"] not in run.log()


def test_a_wrong_password_is_a_clear_configuration_error(stack: dict, tmp_path: Path, unique_name: str) -> None:
    config = pipeline_config(stack, tmp_path, f"saslbad{unique_name}",
                             kafka_bootstrap=stack["EOS_KAFKA_SASL_BOOTSTRAP"])
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=1)
    env = {"EOS_KAFKA_OPTIONS_JSON": json.dumps(sasl_options(stack, password="not-the-password"))}
    run = run_app(config, tmp_path, env_extra=env, timeout=180)
    assert run.process.returncode == 2, run.log()[-3000:]
    assert "refused the credentials" in run.log() and "Kafka connection" in run.log()
    assert "not-the-password" not in run.log()
