"""The sink's test-only fault points (``EOS_FAULT_POINT``, ``sink/batch_sink._fault_injection``):
the batch whose commit they kill at, and with ``EOS_FAULT_SKIP_EMPTY`` never a batch without
records (a continuous cycle past transaction markers only), which a kill test could not use."""

from __future__ import annotations

import signal

import pytest

from spark_apps.eos_stream.sink import batch_sink


def _kills(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
           calls: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
    """The (point, batch number) of each call of the fault hook that would have killed."""
    for key in ("EOS_FAULT_POINT", "EOS_FAULT_AT_BATCH", "EOS_FAULT_SKIP_EMPTY"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    signals: list[int] = []
    monkeypatch.setattr(batch_sink.os, "getpgid", lambda pid: 4242)
    monkeypatch.setattr(batch_sink.os, "killpg", lambda pgid, sig: signals.append(sig))
    crash = batch_sink._fault_injection()
    fired = []
    for where, batch_number, records in calls:
        before = len(signals)
        crash(where, batch_number, records=records)
        if len(signals) > before:
            fired.append((where, batch_number))
    assert set(signals) <= {signal.SIGKILL}
    return fired


CALLS = [("before_commit", 1, 9), ("after_commit", 1, 9), ("before_commit", 2, 0), ("after_commit", 2, 0),
         ("before_commit", 3, 7), ("after_commit", 3, 7)]


def test_a_fault_point_fires_at_its_batch_whatever_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"EOS_FAULT_POINT": "after_commit", "EOS_FAULT_AT_BATCH": "2"}
    assert _kills(monkeypatch, env, CALLS) == [("after_commit", 2)]


def test_skip_empty_fires_at_the_first_batch_with_records_from_its_batch_on(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"EOS_FAULT_POINT": "after_commit", "EOS_FAULT_AT_BATCH": "2", "EOS_FAULT_SKIP_EMPTY": "1"}
    assert _kills(monkeypatch, env, CALLS) == [("after_commit", 3)]
    env["EOS_FAULT_AT_BATCH"] = "1"
    assert _kills(monkeypatch, env, CALLS[:1]) == []  # another point's call
    assert _kills(monkeypatch, env, CALLS[1:2]) == [("after_commit", 1)]


def test_no_fault_point_never_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _kills(monkeypatch, {}, CALLS) == []
