"""Crash matrix: SIGKILL the Spark driver at random moments, then audit.

exactly_once and two_phase must end with 0 duplicates, 0 missing, exact
balances, each account's last_seq that of its last event, and every account's
events in order (docs/ordering.md); the same test on at_least_once must report
duplicates and events out of order, which proves the oracles can fail. In
two_phase the kill "before_commit" falls between PREPARE TRANSACTION and
COMMIT PREPARED, leaving the batch in doubt. In exactly_once, whose batches are
written as prepared parts, "before_commit" leaves undecided parts (P1) and
"after_commit" decided ones not yet committed (P4); the test checks that later
starts found and resolved both.

Every matrix reads the same topic (produced once per module) into its own
pipeline, schemas and checkpoint. A matrix's time is its spark-submit starts:
each kill waits for the driver's startup and its first batch or two, then kills
within the next one (its fault point kills it before that batch commits, at the
latest), so the plan's runs never read the topic to its end.
"""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from spark_apps.eos_stream.run.config import PipelineConfig
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.streaming import audit, ledger_order, pipeline_config, run_app, start_app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EVENTS = 50_000
# Records per micro-batch while the kills happen: small, so a run reaches its kill after a batch or two.
KILL_BATCH = 1500
# The final run only has to finish the topic; bigger batches make it fewer.
FINAL_BATCH = 10_000
# at_least_once's duplicates need one kill between the database's commit and its offsets' (stored right after): the
# "after_commit" fault is one on every run, and the plan's random kills add more chances.
NEGATIVE_CONTROL_KILLS = 3


@pytest.fixture(scope="module")
def ledger_topic(stack: dict) -> str:
    """The 50k committed events (and aborted transactions) every matrix reads, produced once."""
    topic = f"ledger.crash{uuid.uuid4().hex[:10]}"
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=4)
    produced = produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], EVENTS, topic=topic, batch_size=500, abort_every=7,
                              seed=11)
    assert produced.committed == EVENTS and produced.aborted > 0
    return topic


def _kill_plan(kills: int, seed: int) -> list[dict]:
    """Two deterministic crashes at the commit (inside the transaction just
    before COMMIT, and after COMMIT before Spark's checkpoint), the rest at
    random moments: after the run's first or second batch, plus a random delay
    that lands inside the next batch or between two (``_crash_once`` ends it at
    that next batch's commit at the latest)."""
    rng = random.Random(seed)
    plan: list[dict] = [
        {"fault": "after_commit", "at_batch": 2},
        {"fault": "before_commit", "at_batch": 2},
    ]
    plan += [{"after_batches": rng.randint(1, 2), "delay": rng.uniform(0.0, 1.5)} for _ in range(kills - 2)]
    rng.shuffle(plan)
    return plan


def _crash_once(config: dict, tmp_path: Path, step: dict, label: str, resumes: list[dict] | None = None) -> bool:
    """Runs the app until the planned kill; returns whether a kill happened. Adds the run's
    ``resume`` event (what its start found and resolved) to ``resumes``, if given.

    A random kill's delay has no bound in batches: a driver writing small batches can finish
    several within it, and the last runs of a plan would then find the topic read to its end
    (a run that finishes is no kill). So the run's own fault point kills it before the commit
    of the batch after the ones it waits for, should the delay not have run out by then: each
    random run commits at most ``after_batches`` batches, and the plan leaves most of the
    topic to the final run."""
    resumes = [] if resumes is None else resumes
    if "fault" in step:
        env = {"EOS_FAULT_POINT": step["fault"], "EOS_FAULT_AT_BATCH": str(step["at_batch"])}
        run = run_app(config, tmp_path, env_extra=env, label=label, timeout=240)
        resumes += run.events("resume")
        # -9: the app SIGKILLed its own process group at the fault point.
        return run.process.returncode == -9 or "EOS-FAULT" in run.log()
    backstop = {"EOS_FAULT_POINT": "before_commit", "EOS_FAULT_AT_BATCH": str(step["after_batches"] + 1)}
    run = start_app(config, tmp_path, env_extra=backstop, label=label)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and run.process.poll() is None:
        if len(run.events("batch")) >= step["after_batches"]:
            time.sleep(step["delay"])
            break
        time.sleep(0.05)
    if run.process.poll() is None:
        run.kill()
    resumes += run.events("resume")
    return run.process.returncode == -9  # killed here, or by the backstop


def _run_matrix(stack: dict, tmp_path: Path, topic: str, name: str, delivery: str, kills: int,
                **settings: Any) -> tuple[dict, int]:
    config = pipeline_config(stack, tmp_path, name, delivery=delivery, topics=[topic],
                             max_offsets_per_trigger=KILL_BATCH, **settings)
    done = 0
    resumes: list[dict] = []
    for index, step in enumerate(_kill_plan(kills, seed=hash(name) & 0xFFFF)):
        done += _crash_once(config, tmp_path, step, label=f"{delivery}-{index}", resumes=resumes)
    final = run_app({**config, "max_offsets_per_trigger": FINAL_BATCH}, tmp_path, label=f"{delivery}-final",
                    timeout=400)
    assert final.process.returncode == 0, final.log()[-3000:]
    resumes += final.events("resume")
    report = audit(config, tmp_path)
    report["order"] = ledger_order(stack, config["target_schema"])
    report["resumes"] = resumes
    print(f"\n{delivery}: {report['order']}")
    return report, done


# exactly_once's parts are written by the driver while a batch holds at most driver_write_max_records
# (KILL_BATCH's batches do, by default) and by Spark tasks above it: each writer gets its own matrix.
@pytest.mark.parametrize(("delivery", "settings"), [
    ("exactly_once", {}),
    ("exactly_once", {"driver_write_max_records": 0}),
    ("two_phase", {}),
], ids=["exactly_once-driver_writes", "exactly_once-tasks_write", "two_phase"])
def test_exactly_once_survives_sigkills(stack: dict, tmp_path: Path, ledger_topic: str, unique_name: str,
                                        delivery: str, settings: dict[str, Any]) -> None:
    assert KILL_BATCH <= PipelineConfig.driver_write_max_records  # the first case's writer is the driver
    report, kills = _run_matrix(stack, tmp_path, ledger_topic, f"eos{unique_name}", delivery, kills=10, **settings)
    print(f"{delivery}: events={EVENTS} kills={kills} summary={report['summary']} "
          f"aggregates={report['aggregates']}")
    assert kills >= 10
    assert report["summary"]["committed_records"] == EVENTS
    assert report["summary"]["duplicated"] == 0
    assert report["summary"]["missing"] == 0
    assert report["aggregates"]["account_balances"]["keys_wrong"] == 0  # sums and last_seq
    assert report["order"]["split_accounts"] == 0 and report["order"]["out_of_order_accounts"] == 0
    assert report["order"]["accounts"] == report["aggregates"]["account_balances"]["keys"]
    assert report["ok"] and report["exit_code"] == 0
    if delivery == "exactly_once":
        # The kills did land on prepared parts: at the decision's commit a later start committed the
        # decided parts it found (P4), and rolled back undecided ones (P1, a batch written ahead).
        assert {r["write_path"] for r in report["resumes"]} == {"prepared_parts"}
        assert any(r["parts_committed"] for r in report["resumes"]), report["resumes"]
        assert any(r["parts_rolled_back"] for r in report["resumes"]), report["resumes"]
        # Each matrix's kills landed on its own writer's parts (the driver's part is "<batch>:driver:0").
        driver_writes = KILL_BATCH <= settings.get("driver_write_max_records", PipelineConfig.driver_write_max_records)
        found = [gid for r in report["resumes"] for gid in r["parts_committed"] + r["parts_rolled_back"]]
        by_driver = [gid for gid in found if gid.endswith(":driver:0")]
        assert by_driver == (found if driver_writes else []), found


def test_at_least_once_shows_duplicates_under_the_same_crashes(stack: dict, tmp_path: Path, ledger_topic: str,
                                                               unique_name: str) -> None:
    report, kills = _run_matrix(stack, tmp_path, ledger_topic, f"alo{unique_name}", "at_least_once",
                                kills=NEGATIVE_CONTROL_KILLS)
    print(f"at_least_once: events={EVENTS} kills={kills} summary={report['summary']}")
    assert kills >= NEGATIVE_CONTROL_KILLS
    assert report["summary"]["duplicated"] > 0
    assert report["aggregates"]["account_balances"]["keys_wrong"] > 0
    assert report["order"]["out_of_order_accounts"] > 0  # a replayed event repeats an earlier seq
    assert not report["ok"] and report["exit_code"] == 1
