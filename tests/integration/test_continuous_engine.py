"""The continuous engine (``engine: continuous``, spark_apps/eos_stream/engines/continuous.py) against
the real stack: SIGKILLed at random moments while a transactional producer writes (every fourth
transaction aborted), then audited as the crash matrix audits the Spark app.

exactly_once and two_phase must end with 0 duplicates, 0 missing, exact balances and every
account's events in order; the same kills on at_least_once (whose offsets are stored after the
database's commit, in a transaction of their own) must fail the same audit, which proves the
audit can fail. Two kills of each plan are the sink's fault points (inside the commit, and right
after it); the others land at random moments of the engine's life: in its claim, in a cycle's
read, part, apply or commit, or between cycles. A poison record still goes to dead letters.
"""

from __future__ import annotations

import itertools
import random
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.helpers.continuous import LedgerProducer, run_until_caught_up, wait_for_batches
from tests.helpers.kafka import delete_topics
from tests.streaming import (
    audit,
    dead_letter_count,
    ledger_order,
    pg_connect,
    pipeline_config,
    start_continuous,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EVENTS = 12_000  # at least: the producer goes on until the plan's last kill
KILLS = 10
NEGATIVE_CONTROL_KILLS = 3


def _kill_plan(kills: int, seed: int) -> list[dict]:
    """The sink's two fault points at the second cycle, then kills after 0-3 committed cycles
    (0: during the claim or the first cycle) and a random delay."""
    rng = random.Random(seed)
    plan: list[dict] = [{"fault": "after_commit", "at_batch": 2}, {"fault": "before_commit", "at_batch": 2}]
    plan += [{"after_batches": rng.randint(0, 3), "delay": rng.uniform(0.0, 0.4)} for _ in range(kills - 2)]
    rng.shuffle(plan)
    # The run after a fault point resolves the parts that kill left (P1, P4) in its claim, and a
    # kill inside that claim could land after the resolution but before its ``resume`` event:
    # the parts are then resolved, and the test would never hear of it. So that run reaches its
    # first cycle before it is killed; the claim is killed in every other run that draws 0.
    for before, step in itertools.pairwise(plan):
        if "fault" in before and step.get("after_batches") == 0:
            step["after_batches"] = 1
    return plan


def _fault_kills(config: dict, tmp_path: Path, step: dict, label: str) -> tuple[int, list[dict]]:
    """Runs the engine with a sink fault point until the point fires on the pipeline's own write
    path. It fires in a cycle with records (``EOS_FAULT_SKIP_EMPTY``): a cycle past markers only
    (C5) leaves nothing in doubt (two_phase), no part (exactly_once) and nothing to replay twice
    (at_least_once's duplicates); in exactly_once a refused part is staged, and a kill there
    would not exercise the prepared parts' transitions the test asserts (P1, P4).

    :return: the kills, and the runs' resume events.
    """
    faults = {"EOS_FAULT_POINT": step["fault"], "EOS_FAULT_AT_BATCH": str(step["at_batch"]),
              "EOS_FAULT_SKIP_EMPTY": "1"}
    wanted = "(prepared_parts)" if config["delivery"] == "exactly_once" else "EOS-FAULT"
    kills, resumes = 0, []
    for attempt in range(4):
        run = start_continuous(config, tmp_path, label=f"{label}-{attempt}", env_extra=faults)
        try:
            run.wait(120)
        except Exception:
            run.kill()
        kills += run.process.returncode == -9
        resumes += run.events("resume")
        if run.process.returncode == -9 and wanted in run.log():
            return kills, resumes
    raise AssertionError(f"the fault point {step} never fired on the write path {wanted}:\n{run.log()[-3000:]}")


def _kill_once(config: dict, tmp_path: Path, step: dict, label: str) -> tuple[int, list[dict]]:
    """Runs the engine until the planned kill; returns the kills, and the resume events seen."""
    if "fault" in step:
        return _fault_kills(config, tmp_path, step, label)
    run = start_continuous(config, tmp_path, label=label)
    if step["after_batches"]:
        wait_for_batches(run, step["after_batches"], 120)
    else:
        time.sleep(0.5)  # the interpreter's start: the kill lands in the claim or the first cycle
    time.sleep(step["delay"])
    alive = run.process.poll() is None
    run.kill()
    assert alive, f"the engine exited before its kill ({run.process.returncode}):\n{run.log()[-3000:]}"
    return 1, run.events("resume")


def _run_matrix(stack: dict, tmp_path: Path, name: str, delivery: str, kills: int) -> tuple[dict, int, LedgerProducer]:
    topic = f"ledger.{name}"
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=4)
    config = pipeline_config(stack, tmp_path, name, delivery=delivery, topics=[topic], engine="continuous",
                             trigger="processingTime", max_offsets_per_trigger=500, stop_poll_seconds=0.5)
    kills_done = threading.Event()
    producer = LedgerProducer(stack["EOS_KAFKA_BOOTSTRAP"], topic, EVENTS, until=kills_done)
    producer.start()
    killed, resumes, while_producing = 0, [], 0
    try:
        for index, step in enumerate(_kill_plan(kills, seed=hash(name) & 0xFFFF)):
            done, found = _kill_once(config, tmp_path, step, f"{delivery}-{index}")
            killed += done
            while_producing += bool(done) and producer.is_alive()
            resumes += found
    finally:
        kills_done.set()
    # Every kill landed while the producer wrote (it writes until the last one; it ends
    # early only on an error).
    assert while_producing == kills, f"only {while_producing} of {kills} kills while the producer wrote"
    producer.join(300)
    assert producer.error is None and not producer.is_alive(), producer.error
    final = run_until_caught_up(stack, config, tmp_path, [topic], f"{delivery}-final")
    resumes += final.events("resume")
    report = audit(config, tmp_path)
    report["order"] = ledger_order(stack, config["target_schema"])
    report["resumes"] = resumes
    print(f"\n{delivery}: produced={producer.committed} aborted={producer.aborted} kills={killed} "
          f"while_producing={while_producing} "
          f"summary={report['summary']} order={report['order']}")
    delete_topics(stack["EOS_KAFKA_BOOTSTRAP"], topic)
    return report, killed, producer


@pytest.mark.parametrize("delivery", ["exactly_once", "two_phase"])
def test_continuous_engine_is_exact_under_sigkills(stack: dict, tmp_path: Path, unique_name: str,
                                                   delivery: str) -> None:
    report, kills, producer = _run_matrix(stack, tmp_path, f"cont{unique_name}", delivery, KILLS)
    assert kills >= KILLS and producer.aborted > 0
    assert report["summary"]["committed_records"] == producer.committed >= EVENTS
    assert report["summary"]["duplicated"] == 0
    assert report["summary"]["missing"] == 0
    assert report["aggregates"]["account_balances"]["keys_wrong"] == 0  # sums and last_seq
    assert report["order"]["split_accounts"] == 0 and report["order"]["out_of_order_accounts"] == 0
    assert report["ok"] and report["exit_code"] == 0
    # The stored offsets reached the last stable offset (past the last transaction's marker).
    assert all(p["stored_offset"] == p["lso"] for p in report["kafka"].values()), report["kafka"]
    if delivery == "exactly_once":
        # The fault points landed on prepared parts: a later claim committed the decided ones (P4)
        # and rolled back the undecided ones (P1).
        assert {r["write_path"] for r in report["resumes"]} == {"prepared_parts"}
        assert any(r["parts_committed"] for r in report["resumes"]), report["resumes"]
        assert any(r["parts_rolled_back"] for r in report["resumes"]), report["resumes"]
    else:  # the kill between PREPARE TRANSACTION and COMMIT PREPARED left a batch in doubt
        assert any(r["in_doubt_committed"] for r in report["resumes"]), report["resumes"]


def test_at_least_once_shows_duplicates_under_the_same_kills(stack: dict, tmp_path: Path, unique_name: str) -> None:
    report, kills, _ = _run_matrix(stack, tmp_path, f"calo{unique_name}", "at_least_once", NEGATIVE_CONTROL_KILLS)
    assert kills >= NEGATIVE_CONTROL_KILLS
    assert report["summary"]["duplicated"] > 0
    assert report["aggregates"]["account_balances"]["keys_wrong"] > 0
    assert report["order"]["out_of_order_accounts"] > 0  # a replayed cycle repeats an earlier seq
    assert not report["ok"] and report["exit_code"] == 1


def test_poison_goes_to_dead_letters(stack: dict, tmp_path: Path, unique_name: str) -> None:
    name = f"cpois{unique_name}"
    topic = f"ledger.{name}"
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=2)
    produced = produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 2000, topic=topic, batch_size=100, abort_every=5,
                              malformed=2, poison=2, seed=uuid.uuid4().int & 0xFFFF)
    assert produced.malformed == 2 and produced.poison == 2
    config = pipeline_config(stack, tmp_path, name, topics=[topic], engine="continuous", trigger="processingTime",
                             max_batch_attempts=1, stop_poll_seconds=0.5)
    # Until the stored offsets reach the last stable offsets, not for a fixed time: isolating a
    # batch record by record takes what the machine gives it.
    run = run_until_caught_up(stack, config, tmp_path, [topic], "poison")
    conn = pg_connect(stack)
    try:
        assert dead_letter_count(conn, config) == 4
    finally:
        conn.close()
    report = audit(config, tmp_path)
    assert report["ok"] and report["exit_code"] == 0, report
    assert report["summary"]["duplicated"] == 0 and report["summary"]["missing"] == 0
    assert any(b["dead_lettered"] for b in run.events("batch"))
    delete_topics(stack["EOS_KAFKA_BOOTSTRAP"], topic)


def test_sigterm_ends_the_engine_after_the_cycle_in_flight(stack: dict, tmp_path: Path, unique_name: str) -> None:
    """C9: a SIGTERM while records flow ends the engine after its cycle in flight commits, exit
    143 (a supervisor restarts it: nobody asked the pipeline to stop); the rerun finishes exact."""
    name = f"cterm{unique_name}"
    topic = f"ledger.{name}"
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=2)
    producer = LedgerProducer(stack["EOS_KAFKA_BOOTSTRAP"], topic, 3000)
    producer.start()
    config = pipeline_config(stack, tmp_path, name, topics=[topic], engine="continuous", trigger="processingTime",
                             max_offsets_per_trigger=300, stop_poll_seconds=0.5)
    run = start_continuous(config, tmp_path, label="term")
    wait_for_batches(run, 2, 120)
    assert run.process.poll() is None, run.log()[-3000:]
    run.process.send_signal(signal.SIGTERM)
    assert run.wait(30) == 143, run.log()[-3000:]
    assert run.events("stopped")[-1]["reason"].startswith("SIGTERM"), run.log()[-3000:]
    producer.join(120)
    assert producer.error is None
    run_until_caught_up(stack, config, tmp_path, [topic], "after-term")
    report = audit(config, tmp_path)
    assert report["ok"] and report["summary"]["committed_records"] == 3000, report["summary"]
    delete_topics(stack["EOS_KAFKA_BOOTSTRAP"], topic)
