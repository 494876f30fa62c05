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
from spark_apps.eos_stream.sink.batch_sink import StagedBatch


def _ahead(notify=None) -> ApplyAhead:
    sink = SimpleNamespace(stage_name=lambda batch_id: f"stage_{batch_id}", spec=mock.Mock(), meta_schema="m")
    return ApplyAhead(sink, connect=mock.MagicMock, notify=notify)  # type: ignore[arg-type]


def test_applies_run_on_one_other_thread_one_at_a_time_in_order() -> None:
    ahead, log = _ahead(), []

    def apply(n: int) -> None:
        log.append(("start", n, threading.current_thread().name))
        time.sleep(0.05)
        log.append(("end", n))

    for n in range(3):
        ahead.submit(lambda n=n: apply(n))
    ahead.finish()
    ahead.close()
    assert [entry[:2] for entry in log] == [("start", 0), ("end", 0), ("start", 1), ("end", 1),
                                             ("start", 2), ("end", 2)]
    assert {entry[2] for entry in log if entry[0] == "start"} != {threading.current_thread().name}


def test_a_failed_apply_is_raised_before_the_next_batch_starts() -> None:
    ahead, started = _ahead(), []

    def fail() -> None:
        raise RuntimeError("batch 4 failed")

    ahead.submit(fail)
    with pytest.raises(RuntimeError, match="batch 4 failed"):
        ahead.submit(lambda: started.append(5))
    ahead.close()
    assert started == []  # batch 5 was never handed over


def test_the_end_of_the_run_waits_for_the_last_apply_and_raises_its_error() -> None:
    ahead, done = _ahead(), []
    ahead.submit(lambda: (time.sleep(0.1), done.append(1)))
    ahead.finish()
    assert done == [1]
    ahead.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ahead.finish()
    ahead.finish()  # reported once
    ahead.close()


def test_staging_ahead_reports_its_rows_and_time() -> None:
    with mock.patch("spark_apps.eos_stream.sink.apply_ahead.create_stage") as create:
        staged = _ahead().stage(7, lambda name, keep_raw: 42 if (name, keep_raw) == ("stage_7", False) else -1)
    assert create.call_args.args[3] == "stage_7"
    assert isinstance(staged, StagedBatch) and (staged.name, staged.rows) == ("stage_7", 42) and staged.stage_ms >= 0


def test_a_failure_to_stage_ahead_is_no_error_but_leaves_staging_to_the_apply() -> None:
    events = []

    def fill(name: str, keep_raw: bool) -> int:
        raise OSError("executor lost")

    with mock.patch("spark_apps.eos_stream.sink.apply_ahead.create_stage"):
        staged = _ahead(notify=lambda event, **fields: events.append((event, fields))).stage(3, fill)
    assert staged is None
    assert events == [("stage_ahead_failed", {"batch_id": 3, "error": "executor lost"})]
