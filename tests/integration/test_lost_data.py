"""Lost data on the real stack: records deleted before they were applied, and a topic recreated
under a pipeline, fail the run with exit 4 and a message naming each partition; ``eos offsets
reset`` moves the stored offsets on purpose, and the audit reports the skipped range as an
accepted gap."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg2 import sql

from spark_apps.eos_stream.kafka.lost_data import EXIT_DATA_LOST, log_bounds
from spark_apps.eos_stream.kafka.metadata import KafkaUnavailable
from spark_apps.eos_stream.state import meta_tables
from spark_apps.eos_stream.state.control import hold_running_lock
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.helpers.kafka import delete_topics
from tests.streaming import ROOT, audit, ledger_rows, pg_connect, pipeline_config, run_app

pytestmark = pytest.mark.integration


def _stored(stack: dict[str, str], config: dict[str, Any]) -> dict[tuple[str, int], int]:
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT topic, partition, next_offset FROM {} WHERE pipeline = %s").format(
            meta_tables.table(config["meta_schema"], meta_tables.OFFSETS)), (config["pipeline"],))
        found = {(t, p): o for t, p, o in cur.fetchall()}
    conn.close()
    return found


def _eos_reset(config_path: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "airflow_provider_eos.cli", "offsets", "reset", name,
                           "--config", str(config_path), "--to", "earliest", *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def _lost_error(run: Any) -> dict[str, Any]:
    errors = run.events("error")
    assert errors and errors[-1]["kind"] == "data_lost", run.log()[-4000:]
    return errors[-1]


def test_records_deleted_before_they_were_applied(stack: dict[str, str], tmp_path: Path, unique_name: str) -> None:
    config = pipeline_config(stack, tmp_path, f"lost{unique_name}")
    topic, bootstrap, name = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"], config["pipeline"]
    ensure_topic(bootstrap, topic, partitions=2)
    produce_ledger(bootstrap, 400, topic=topic, seed=1)
    assert run_app(config, tmp_path, label="first").process.returncode == 0
    applied = ledger_rows(stack, config["target_schema"])
    assert applied == 400
    stored = _stored(stack, config)[(topic, 0)]
    produce_ledger(bootstrap, 400, topic=topic, seed=2, first_seq=10_000)
    _start, end = log_bounds(bootstrap, {}, [(topic, 0)])[(topic, 0)]
    cut = stored + (end - stored) // 2  # half of partition 0's unapplied records go
    assert stored < cut < end
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_records([TopicPartition(topic, 0, cut)], request_timeout=30).values():
        future.result(30)

    lost = run_app(config, tmp_path, label="lost")
    assert lost.process.returncode == EXIT_DATA_LOST, lost.log()[-4000:]
    message = _lost_error(lost)["message"]
    assert f"{topic}[0]: stored offset {stored}, log start {cut}, log end {end}" in message
    assert "eos offsets reset" in message and f"{topic}[1]" not in message
    assert f"eos-stream: data lost: pipeline {name!r} lost data: {topic}[0]" in lost.log()
    assert ledger_rows(stack, config["target_schema"]) == applied  # nothing applied
    before_reset = audit(config, tmp_path)  # the negative control: the gap is a mismatch
    assert not before_reset["ok"] and f"retention_gap:{topic}:0" in before_reset["mismatches"], before_reset

    config_path = tmp_path / f"{name}.json"  # written by run_app
    guard = pg_connect(stack)
    hold_running_lock(guard, name)  # a driver "running"
    refused = _eos_reset(config_path, name, "--reason", "test", "--yes")
    guard.close()
    assert refused.returncode == 1 and "another driver" in refused.stdout, refused.stdout + refused.stderr
    plan = _eos_reset(config_path, name, "--reason", "retention ran ahead of the pipeline")
    assert plan.returncode == 0 and f"would move {topic}[0]: {stored} -> {cut}" in plan.stdout, plan.stdout
    assert _stored(stack, config)[(topic, 0)] == stored  # a plan changes nothing
    moved = _eos_reset(config_path, name, "--reason", "retention ran ahead of the pipeline", "--yes")
    assert moved.returncode == 0 and f"moved {topic}[0]: {stored} -> {cut}" in moved.stdout, moved.stdout + moved.stderr
    print(lost.events("error")[-1]["message"], plan.stdout, moved.stdout, sep="\n")

    resumed = run_app(config, tmp_path, label="resumed")
    assert resumed.process.returncode == 0, resumed.log()[-4000:]
    report = audit(config, tmp_path)
    assert report["ok"], report
    assert [(g["topic"], g["partition"], g["from_offset"], g["to_offset"], g["reason"])
            for g in report["accepted_gaps"]] == [(topic, 0, stored, cut, "retention ran ahead of the pipeline")]
    assert report["summary"]["accepted_gap_offsets"] == cut - stored
    assert report["summary"]["missing"] == 0


def test_topic_recreated_under_the_pipeline(stack: dict[str, str], tmp_path: Path, unique_name: str) -> None:
    """exactly_once: the claim finds the stored offset past the new log's end, before Spark starts."""
    config = pipeline_config(stack, tmp_path, f"recr{unique_name}")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=1)
    produce_ledger(bootstrap, 300, topic=topic, seed=1)
    assert run_app(config, tmp_path, label="first").process.returncode == 0
    stored = _stored(stack, config)[(topic, 0)]
    _recreate(bootstrap, topic)
    produce_ledger(bootstrap, 50, topic=topic, seed=3, first_seq=20_000)
    _start, end = log_bounds(bootstrap, {}, [(topic, 0)])[(topic, 0)]
    assert end < stored

    lost = run_app(config, tmp_path, label="recreated")
    assert lost.process.returncode == EXIT_DATA_LOST, lost.log()[-4000:]
    message = _lost_error(lost)["message"]
    assert f"{topic}[0]: stored offset {stored}, log start 0, log end {end}" in message
    assert "recreated" in message
    assert ledger_rows(stack, config["target_schema"]) == 300


def test_spark_data_loss_mid_stream_names_the_jvm_cause(stack: dict[str, str], tmp_path: Path,
                                                        unique_name: str) -> None:
    """at_least_once's claim does not check its stored offsets against the log (``start.claim``),
    so the loss surfaces inside Spark's Kafka source, in the JVM, as the source starts from them:
    the run still exits 4 and names the Java cause, not the query's id."""
    config = pipeline_config(stack, tmp_path, f"jvm{unique_name}", delivery="at_least_once")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=1)
    produce_ledger(bootstrap, 300, topic=topic, seed=1)
    assert run_app(config, tmp_path, label="first").process.returncode == 0
    _recreate(bootstrap, topic)
    produce_ledger(bootstrap, 50, topic=topic, seed=3, first_seq=20_000)

    lost = run_app(config, tmp_path, label="recreated")
    assert lost.process.returncode == EXIT_DATA_LOST, lost.log()[-4000:]
    message = _lost_error(lost)["message"]
    print(message)
    assert "Identifier:" not in message
    assert "KafkaIllegalStateException" in message or "data may have been lost" in message, message


def _recreate(bootstrap: str, topic: str) -> None:
    delete_topics(bootstrap, topic)
    deadline = time.monotonic() + 60
    while True:  # the deletion completes asynchronously
        try:
            ensure_topic(bootstrap, topic, partitions=1)
            metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
            if metadata.topics[topic].error is None and log_bounds(bootstrap, {}, [(topic, 0)])[(topic, 0)] == (0, 0):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        time.sleep(1)


def test_log_bounds_a_broker_cannot_give_name_the_partition_and_are_retryable(stack: dict, unique_name: str) -> None:
    """A partition the topic's leader does not know (as one created moments ago, before its
    leader has it) is Kafka's UNKNOWN_TOPIC_OR_PART: the claim's check of the stored offsets says
    which partition and that it is retried, instead of failing on a bare KafkaException."""
    topic = f"ledger.bounds{unique_name}"
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=1)
    try:
        assert log_bounds(stack["EOS_KAFKA_BOOTSTRAP"], {}, [(topic, 0)]) == {(topic, 0): (0, 0)}
        with pytest.raises(KafkaUnavailable, match=rf"earliest offset of {re.escape(topic)}\[3\]: "
                                                   r".*(Unknown partition|UNKNOWN_TOPIC_OR_PART).*retried"):
            log_bounds(stack["EOS_KAFKA_BOOTSTRAP"], {}, [(topic, 0), (topic, 3)], timeout=10)
    finally:
        delete_topics(stack["EOS_KAFKA_BOOTSTRAP"], topic)
