"""``progress.RowsRead``: the progress listener's input rows, which a batch staged ahead
reports after Spark reported the batch's progress (the real listener runs in every app test)."""

from __future__ import annotations

import threading
import time

from spark_apps.eos_stream.engines.spark_progress import RowsRead


def test_the_listener_waits_for_a_batch_still_staging() -> None:
    rows = RowsRead()
    threading.Timer(0.2, rows.record, args=(7, 100_000)).start()
    started = time.monotonic()
    assert rows.take(7, timeout=5) == 100_000
    assert 0.15 < time.monotonic() - started < 5


def test_a_retry_does_not_count_the_batch_twice_and_a_batch_is_taken_once() -> None:
    rows = RowsRead()
    rows.record(3, 10)
    rows.record(3, 10)  # its apply staged it again
    assert rows.take(3, timeout=0) == 10
    assert rows.take(3, timeout=0.05) is None


def test_a_batch_that_never_staged_gives_up_after_the_timeout_or_when_the_run_ends() -> None:
    assert RowsRead().take(1, timeout=0.1) is None
    rows = RowsRead()
    threading.Timer(0.1, rows.close).start()
    started = time.monotonic()
    assert rows.take(2, timeout=30) is None
    assert time.monotonic() - started < 5
