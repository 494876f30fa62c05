"""Apply-ahead's ordering and error hand-over (``sink/apply_ahead.py``), without Spark or a database.

Its behaviour against the real stack is every app test in exactly_once and two_phase
(the crash matrices kill it at random moments; the poison test retries and isolates
on its applier thread)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from unittest import mock

import pytest

from spark_apps.eos_stream.sink.apply_ahead import ApplyAhead
from spark_apps.eos_stream.sink.parts import WrittenParts
from spark_apps.eos_stream.sink.writer import StagedBatch


def _ahead(notify=None) -> ApplyAhead:
    sink = SimpleNamespace(stage_name=lambda batch_id: f"stage_{batch_id}", spec=mock.Mock(), meta_schema="m")
    return ApplyAhead(sink, connect=mock.MagicMock, notify=notify)  # type: ignore[arg-type]


def _fill(log: list | None = None, seconds: float = 0.0):
    def fill(name: str, keep_raw: bool) -> int:
        if log is not None:
            log.append(("stage", name, threading.current_thread().name))
        time.sleep(seconds)
        return 1
    return fill


@pytest.fixture(autouse=True)
def _no_database():
    with mock.patch("spark_apps.eos_stream.sink.apply_ahead.create_stage"):
        yield


def test_batches_stage_and_apply_on_other_threads_one_at_a_time_in_order() -> None:
    ahead, log = _ahead(), []

    def apply(n: int, staged: StagedBatch | None) -> None:
        assert staged is not None and staged.name == f"stage_{n}"  # its own staging, already done
        log.append(("start", n, threading.current_thread().name))
        time.sleep(0.05)
        log.append(("end", n))

    for n in range(3):
        ahead.hand_over(n, _fill(log), lambda staged, n=n: apply(n, staged))
    ahead.finish()
    ahead.close()
    assert [entry[:2] for entry in log if entry[0] != "stage"] == [
        ("start", 0), ("end", 0), ("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    assert [entry[1] for entry in log if entry[0] == "stage"] == ["stage_0", "stage_1", "stage_2"]
    assert threading.current_thread().name not in {entry[2] for entry in log if len(entry) > 2}


def test_hand_over_returns_once_the_previous_staging_ended_not_its_own() -> None:
    ahead, staged_at = _ahead(), {}

    def fill(name: str, keep_raw: bool) -> int:
        time.sleep(0.3)
        staged_at[name] = time.monotonic()
        return 1

    ahead.hand_over(0, fill, lambda staged: None)
    ahead.hand_over(1, fill, lambda staged: None)
    returned = time.monotonic()
    ahead.finish()
    ahead.close()
    assert staged_at["stage_0"] <= returned < staged_at["stage_1"]  # one staging at a time, none waited for


def test_a_failed_apply_stops_every_later_batch_and_is_raised_once() -> None:
    ahead, applied = _ahead(), []

    def fail(staged: StagedBatch | None) -> None:
        time.sleep(0.2)  # fails after batch 5 was handed over
        raise RuntimeError("batch 4 failed")

    ahead.hand_over(4, _fill(), fail)
    ahead.hand_over(5, _fill(), lambda staged: applied.append(5))
    with pytest.raises(RuntimeError, match="batch 4 failed"):
        ahead.finish()
    assert applied == []  # batch 5 never applied: it would have committed past a failed batch
    ahead.finish()  # reported once
    ahead.close()


def test_a_known_failure_is_raised_when_the_next_batch_is_handed_over() -> None:
    ahead, applied = _ahead(), []
    ahead.hand_over(4, _fill(), lambda staged: 1 / 0)
    time.sleep(0.3)
    with pytest.raises(ZeroDivisionError):
        ahead.hand_over(5, _fill(), lambda staged: applied.append(5))
    ahead.finish()
    ahead.close()
    assert applied == []


def test_staging_ahead_reports_its_rows_and_time() -> None:
    with mock.patch("spark_apps.eos_stream.sink.apply_ahead.create_stage") as create:
        staged = _ahead().stage(7, lambda name, keep_raw: 42 if (name, keep_raw) == ("stage_7", False) else -1)
    assert create.call_args.args[3] == "stage_7"
    assert isinstance(staged, StagedBatch) and (staged.name, staged.count.rows) == ("stage_7", 42)
    assert staged.stage_ms >= 0


def test_a_failure_to_stage_ahead_is_no_error_but_leaves_staging_to_the_apply() -> None:
    events = []

    def fill(name: str, keep_raw: bool) -> int:
        raise OSError("executor lost")

    with mock.patch("spark_apps.eos_stream.sink.apply_ahead.create_stage"):
        staged = _ahead(notify=lambda event, **fields: events.append((event, fields))).stage(3, fill)
    assert staged is None
    assert events == [("stage_ahead_failed", {"batch_id": 3, "error": "executor lost"})]


def _parts_ahead(notify=None) -> tuple[ApplyAhead, list]:
    dropped: list = []
    sink = SimpleNamespace(stage_name=lambda batch_id: f"stage_{batch_id}", spec=mock.Mock(), meta_schema="m",
                           parts_prefix=lambda batch_id: f"eos-part:p:1:{batch_id}:",
                           drop_parts=dropped.append)
    return ApplyAhead(sink, connect=mock.MagicMock, notify=notify), dropped  # type: ignore[arg-type]


def test_a_batch_written_as_parts_is_not_staged() -> None:
    ahead, _ = _parts_ahead()
    seen: list = []
    result = {"gid": "eos-part:p:1:0:0:7", "rows": 5, "deltas": [], "refused": None}
    with mock.patch("spark_apps.eos_stream.sink.apply_ahead.parts.gather",
                    return_value=WrittenParts(("g",), 5, [], 0, "eos-part:p:1:0:")) as gather:
        ahead.hand_over(0, _fill(seen), seen.append, lambda prefix: [result])
        ahead.finish()
        ahead.close()
    assert gather.call_args.args[:3] == ([result], ahead._sink.spec, "eos-part:p:1:0:")
    assert [type(s) for s in seen] == [WrittenParts]  # handed to the apply, never staged


@pytest.mark.parametrize("outcome", ["refused", "failed"])
def test_parts_that_cannot_be_written_are_rolled_back_and_the_batch_staged(outcome: str) -> None:
    events: list = []
    ahead, _ = _parts_ahead(notify=lambda event, **fields: events.append(event))
    seen: list = []

    def write_parts(prefix: str) -> list:
        if outcome == "failed":
            raise RuntimeError("a task failed")
        return [{"gid": None, "rows": 3, "deltas": [], "refused": "the database refused the part: 22001"}]

    with mock.patch("spark_apps.eos_stream.sink.apply_ahead.parts.roll_back") as roll_back:
        ahead.hand_over(0, _fill(seen), seen.append, write_parts)
        ahead.finish()
        ahead.close()
    assert roll_back.call_args.args[1] == "eos-part:p:1:0:"
    assert events == [f"parts_{outcome}"]
    assert [type(s) for s in seen if not isinstance(s, tuple)] == [StagedBatch]


def test_parts_of_a_batch_after_a_failed_one_are_dropped_not_decided() -> None:
    ahead, dropped = _parts_ahead()
    written = WrittenParts(("g",), 5, [], 0, "eos-part:p:1:1:")

    def fail(staged: object) -> None:
        time.sleep(0.2)  # batch 1 is handed over and written meanwhile
        raise RuntimeError("batch 0 failed")

    with mock.patch("spark_apps.eos_stream.sink.apply_ahead.parts.gather", return_value=written):
        ahead.hand_over(0, _fill(), fail)
        ahead.hand_over(1, _fill(), pytest.fail, lambda prefix: [])
        with pytest.raises(RuntimeError, match="batch 0 failed"):
            ahead.finish()
    ahead.close()
    assert dropped == ["eos-part:p:1:1:"]  # A2: no later batch is decided; its parts are rolled back
