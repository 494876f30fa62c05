"""The Spark-less replay (``direct_replay``) against the real Kafka and PostgreSQL.

It must give what the Spark app gives: every committed record exactly once
(aborted transactions never), the same dead letters, and an exact target
after a SIGKILL at any batch boundary (in exactly_once the batches are written
as prepared parts, so the kills land between a part's decision and its commit). The crash test also runs on
``at_least_once``, where the kill after a commit (before the offsets stored after it) must leave
duplicates the audit sees.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spark_apps.eos_stream.kafka.lost_data import EXIT_DATA_LOST
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.streaming import audit, dead_letter_count, ledger_rows, pg_connect, pipeline_config, run_direct_replay

pytestmark = pytest.mark.integration


def _replay(config: dict, tmp_path: Path, env_extra: dict[str, str] | None = None) -> tuple[int, list[dict], str]:
    """Runs the replay in its own process group (a fault point kills the whole group);
    returns its exit code, its batch events and its log (stdout and stderr)."""
    result = run_direct_replay(config, tmp_path, env_extra)
    batches = [json.loads(line[len("EOS-BATCH "):]) for line in result.stdout.splitlines()
               if line.startswith("EOS-BATCH ")]
    return result.returncode, batches, result.stdout + result.stderr


def test_direct_replay_applies_committed_records_once_with_dead_letters(stack: dict, tmp_path: Path,
                                                                        unique_name: str) -> None:
    config = pipeline_config(stack, tmp_path, f"direct{unique_name}", max_offsets_per_trigger=2500,
                             max_batch_attempts=2)
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=3)
    produced = produce_ledger(bootstrap, 9000, topic=topic, abort_every=3, malformed=2, poison=1, seed=21)
    code, batches, log = _replay(config, tmp_path)
    # The poison batch fails max_batch_attempts times and is isolated, in this one run.
    assert code == 0, log[-4000:]
    assert any(b["record_by_record"] for b in batches)
    # Clean batches are written as prepared parts, as the app's tasks write them; a batch with a
    # record Python or PostgreSQL refuses falls back to staging, where the database judges it.
    assert '"write_path": "prepared_parts"' in log, log[-4000:]
    assert any("commit_parts" in b["timings_ms"] for b in batches), batches
    assert "EOS-PARTS_REFUSED" in log and any("commit_parts" not in b["timings_ms"] for b in batches)
    report = audit(config, tmp_path)
    assert report["ok"], report
    assert report["summary"]["dead_lettered"] == produced.malformed + produced.poison == 3
    # More events later: the next replay starts at the stored offsets.
    produce_ledger(bootstrap, 3000, topic=topic, seed=22, first_seq=100_000)
    code, batches, _ = _replay(config, tmp_path)
    assert code == 0 and sum(b["applied"] for b in batches) == 3000
    assert audit(config, tmp_path)["ok"]


@pytest.mark.parametrize(("delivery", "exact"), [("exactly_once", True), ("two_phase", True),
                                                 ("at_least_once", False)])
@pytest.mark.parametrize("point", ["before_commit", "after_commit"])
def test_sigkilled_direct_replay_stays_exact(stack: dict, tmp_path: Path, unique_name: str, delivery: str,
                                             exact: bool, point: str) -> None:
    config = pipeline_config(stack, tmp_path, f"dkill{unique_name}", delivery=delivery, max_offsets_per_trigger=1500)
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=2)
    produce_ledger(bootstrap, 6000, topic=topic, abort_every=4, seed=23)
    code, _, _ = _replay(config, tmp_path, {"EOS_FAULT_POINT": point, "EOS_FAULT_AT_BATCH": "3"})
    assert code == -9, code  # SIGKILLed at the fault point
    code, _, _ = _replay(config, tmp_path)
    assert code == 0
    report = audit(config, tmp_path)
    if exact or point == "before_commit":
        # at_least_once stores its offsets right after each batch's commit: a kill before a commit
        # replays no committed batch.
        assert report["ok"], report
    else:  # killed between the batch's commit and its offsets': the rerun applies the batch again
        assert not report["ok"] and report["summary"]["duplicated"] > 0, report


def _stored_state(stack: dict, config: dict) -> tuple[dict, int, int]:
    """(stored offsets, target rows, dead letters) as the database holds them."""
    from spark_apps.eos_stream.sink.offsets_store import OffsetsStore

    conn = pg_connect(stack)
    try:
        offsets = OffsetsStore(config["meta_schema"], config["pipeline"]).load(conn)
        dead = dead_letter_count(conn, config)
    finally:
        conn.close()
    return offsets, ledger_rows(stack, config["target_schema"]), dead


def test_replay_of_records_gone_from_kafka_fails_and_writes_nothing(stack: dict, tmp_path: Path,
                                                                     unique_name: str) -> None:
    """R3: the records after the stored offsets were deleted (retention, here
    ``DeleteRecords``). The replay must fail at once, say which offset is gone,
    and leave the target, the offsets and the dead letters as they were: a
    skipped range would be silent loss, and a broker error is not poison."""
    from confluent_kafka import TopicPartition as KafkaPartition
    from confluent_kafka.admin import AdminClient

    config = pipeline_config(stack, tmp_path, f"gone{unique_name}", max_offsets_per_trigger=1000,
                             transient_retry_seconds=30)
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=1)
    produce_ledger(bootstrap, 2000, topic=topic, seed=24)
    code, _, _ = _replay(config, tmp_path)
    assert code == 0
    before = _stored_state(stack, config)
    assert before[1] == 2000 and before[2] == 0, before
    (stored,) = before[0].values()

    produce_ledger(bootstrap, 2000, topic=topic, seed=25, first_seq=100_000)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deleted = admin.delete_records([KafkaPartition(topic, 0, stored + 500)], request_timeout=30)
    low = next(iter(deleted.values())).result().low_watermark
    assert low == stored + 500, low

    code, batches, log = _replay(config, tmp_path)
    # Lost data, found at the claim before anything is read: exit 4, naming the partition, the
    # stored offset and the log's start (kafka/lost_data.py), not a failure to retry.
    assert code == EXIT_DATA_LOST, (code, log[-3000:])
    assert batches == [], batches  # no batch committed
    assert f"[0]: stored offset {stored}, log start {low}" in log, log[-3000:]
    assert "EOS-RETRY" not in log, log[-3000:]  # a broker's answer is not a transient database error
    assert _stored_state(stack, config) == before
