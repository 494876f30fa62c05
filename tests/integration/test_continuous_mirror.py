"""The continuous engine (``engine: continuous``) on a change stream's mirror: Debezium's
records of three tables (``bench/cdc_changes.ChangeStream``: creates, updates of keys changed
several times within a cycle, deletes with their tombstones), committed in Kafka transactions.
The engine is SIGKILLed at the sink's two fault points and at random moments, then runs until
its stored offsets reach every partition's last stable offset; every mirror table must then
equal the rows the stream leaves (0 rows differ), which no replayed older change could leave.
A mirror writes the staged way (upserts and deletes by key), so its cycles go through the
sink's transitions 1-10 and the engine's C1-C8 (``engines/continuous.py``).

What this oracle catches: a lost change, and an older change of a key applied after a newer one.
A whole cycle replayed in Kafka order converges to the same rows, so a mirror's final state
cannot show a replay; the mirror's negative control (changes replayed below the stored offsets
without the offsets' check, which every table then shows) is in ``test_cdc_mirror.py``."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from bench.cdc_changes import ChangeStream
from bench.cdc_throughput import differences, mirror_definition, produce
from tests.helpers.continuous import run_until_caught_up
from tests.streaming import AppRun, pipeline_config, start_continuous

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CHANGES = 6000


def _killed_run(config: dict, tmp_path: Path, label: str, faults: dict[str, str] | None, delay: float) -> AppRun:
    """One engine run ended by its fault point, or by a SIGKILL ``delay`` seconds after its
    first committed cycle, within the second cycle at the latest: a fault point before that
    cycle's commit ends the run if the delay has not. So a plan's runs commit at most six
    cycles of 700 records, and each random kill finds records for its run's first cycle."""
    if faults:
        run = start_continuous(config, tmp_path, label=label, env_extra=faults)
        run.wait(120)
        return run
    backstop = {"EOS_FAULT_POINT": "before_commit", "EOS_FAULT_AT_BATCH": "2"}
    run = start_continuous(config, tmp_path, label=label, env_extra=backstop)
    deadline = time.monotonic() + 120
    while not run.events("batch") and run.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.events("batch"), f"the engine committed no cycle before its kill:\n{run.log()[-3000:]}"
    time.sleep(delay)
    run.kill()
    return run


def test_the_continuous_engine_mirrors_a_change_stream_exactly_under_sigkills(stack: dict, tmp_path: Path,
                                                                              unique_name: str) -> None:
    stream = ChangeStream(3, CHANGES, prefix=f"cm{unique_name}", seed=36)
    produced = produce(stack, stream, partitions=2)
    definition = tmp_path / "mirror.json"
    definition.write_text(json.dumps(mirror_definition(stream)))
    config = pipeline_config(stack, tmp_path, f"cmir{unique_name}", topics=stream.topics(),
                             spec=f"mirror:{definition}", max_offsets_per_trigger=700, stop_poll_seconds=0.5)
    rng = random.Random(36)
    plan = [{"EOS_FAULT_POINT": "before_commit", "EOS_FAULT_AT_BATCH": "2"},
            {"EOS_FAULT_POINT": "after_commit", "EOS_FAULT_AT_BATCH": "2"}, None, None, None]
    killed = 0
    for index, faults in enumerate(plan):
        run = _killed_run(config, tmp_path, f"kill-{index}", faults, rng.uniform(0.0, 0.3))
        killed += run.process.returncode == -9
    assert killed == len(plan), f"{killed} of {len(plan)} runs were SIGKILLed"

    final = run_until_caught_up(stack, config, tmp_path, stream.topics(), "final")
    differ = differences(stack, config["target_schema"], stream.final_rows())
    rows = {table: len(keys) for table, keys in stream.final_rows().items()}
    print(f"\nproduced {produced}; {killed} kills; rows per table {rows}; rows that differ {differ}")
    assert all(rows.values()) and differ == {table: 0 for table in rows}, differ
    batches = final.events("batch")
    assert batches and not any(b["dead_lettered"] for b in batches)
