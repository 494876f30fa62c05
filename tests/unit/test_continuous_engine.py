"""The continuous engine's pure parts: a cycle's ranges from the consumer's positions, the check
that every polled record lies in them, and the launcher's folding of its per-cycle events."""

from __future__ import annotations

import json

import pytest

from spark_apps.eos_stream.engines.continuous_read import _NO_POSITION, check_messages, moved_ranges
from spark_apps.eos_stream.kafka.ranges import EARLIEST

A0, A1, A2 = ("a", 0), ("a", 1), ("a", 2)


class Message:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def topic(self) -> str:
        return "a"

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


def test_only_moved_partitions_make_the_cycle_and_end_at_the_position() -> None:
    current = {A0: 10, A1: EARLIEST, A2: 7}
    # a0 moved past a marker to 15; a1 was never applied and reached 3; a2 handed out nothing.
    starts, ends = moved_ranges(current, {A0: 15, A1: 3, A2: _NO_POSITION})
    assert starts == {A0: 10, A1: EARLIEST} and ends == {A0: 15, A1: 3}
    assert moved_ranges(current, {A0: 10, A1: _NO_POSITION, A2: 7}) == ({}, {})


def test_a_position_below_the_start_fails_the_cycle() -> None:
    with pytest.raises(RuntimeError, match="below the cycle's start"):
        moved_ranges({A0: 10}, {A0: 9})


def test_every_polled_record_must_lie_in_its_partitions_range() -> None:
    starts, ends = {A0: 10, A1: EARLIEST}, {A0: 15, A1: 3}
    check_messages([Message(0, 10), Message(0, 13), Message(1, 0), Message(1, 2)], starts, ends)
    for outside in (Message(0, 15), Message(0, 9), Message(2, 0)):
        with pytest.raises(RuntimeError, match="outside the cycle's range"):
            check_messages([outside], starts, ends)


def test_the_launcher_folds_each_cycles_batch_event_into_one() -> None:
    from airflow_provider_eos.launchers.child_process import ChildProcessLauncher
    from airflow_provider_eos.launchers.result import AppRunResult
    from airflow_provider_eos.operators.supervision import attempt_info

    launcher = ChildProcessLauncher()
    launcher.on_line('EOS-RESUME {"epoch": 2}')
    for batch in range(3):
        launcher.on_line("EOS-BATCH " + json.dumps({"batch_id": batch, "applied": 10, "dead_lettered": batch,
                                                     "end_offsets": {"a": {"0": batch}}}))
    launcher.on_line('EOS-RETRY {"batch_id": 3}')
    launcher.on_line('EOS-BATCH {"batch_id": 3, "applied": 1, "dead_lettered": 0}')
    events = launcher.event_log.events
    kinds = [kind for kind, _ in events]
    assert kinds == ["resume", "batch", "retry", "batch"]
    folded = events[1][1]
    assert folded["folded_batches"] == 3 and folded["applied"] == 30 and folded["dead_lettered"] == 3
    assert folded["end_offsets"] == {"a": {"0": 2}} and folded["batch_id"] == 2
    info = attempt_info(1, AppRunResult(0, list(events)))
    assert info["batches"] == 4 and info["rows_applied"] == 31 and info["dead_lettered"] == 3


def test_the_launcher_runs_the_engine_as_its_own_process_and_reads_its_exit() -> None:
    """A config the engine refuses: it runs (no Spark, no Spark hook, no stack needed), reports a
    config error and exits 2, and the secret reaches neither its command line nor its config file."""
    from airflow_provider_eos.launchers.child_process import ChildProcessLauncher
    from airflow_provider_eos.launchers.protocol import run_to_end
    from spark_apps.eos_stream.run.config import PipelineConfig, PostgresTarget

    launcher = ChildProcessLauncher()
    config = PipelineConfig(pipeline="p", topics=["t"], spec="spark_apps.ledger.spec:LEDGER", engine="continuous",
                            continuous_linger_ms=-1, postgres=PostgresTarget(password="s3cret"))
    seen: list[str] = []
    result = run_to_end(launcher, config, lambda kind, data: seen.append(kind))
    assert result.returncode == 2 and result.config_error, result
    assert "continuous_linger_ms must be 0 or more" in result.last_error["message"]
    assert "error" in seen
    assert launcher.process is not None and "s3cret" not in " ".join(launcher.process.args)
