"""A driver's start (``engines.start._claim``) keeps its order: the in-doubt batches of a dead
driver first, a stop request honoured before anyone is fenced, the epoch bump, the parts of the
fenced epochs, the running lock, the epoch and the stop checked again under it, and only then the
targets and the resume point. Each step is recorded here in place of the database and Kafka."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from spark_apps.eos_stream.engines import start
from spark_apps.eos_stream.state import fencing

PROTOCOL = ["check_two_phase", "check_encoding", "resolve_in_doubt", "ensure_meta_tables", "stop_requested",
            "bump_epoch", "resolve_parts", "hold_running_lock", "current_epoch", "stop_requested",
            "create_targets", "check_targets", "kafka_partitions", "drop_stages", "load_offsets",
            "transaction_topic_problem", "check_stored_offsets", "prepared_parts", "emit:resume", "Driver"]


class _Steps:
    """Records each step's name; ``stop_at``: the stop_requested call (1st, 2nd) that finds a stop;
    ``epoch_now``: what the epoch reads under the running lock."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stop_at: int = 0, epoch_now: int = 7) -> None:
        self.names: list[str] = []
        self.stop_at, self.stops = stop_at, 0
        steps: dict[tuple[Any, str], Any] = {
            (start.preflight, "check_two_phase"): None, (start.preflight, "check_encoding"): None,
            (start, "resolve_in_doubt"): [], (start.preflight, "ensure_meta_tables"): None,
            (fencing, "bump_epoch"): 7, (start.parts, "resolve"): {"committed": [], "rolled_back": []},
            (start, "hold_running_lock"): None, (fencing, "current_epoch"): epoch_now,
            (start.preflight, "create_targets"): None, (start.preflight, "check_targets"): None,
            (start.preflight, "kafka_partitions"): {"t": [0]}, (start, "drop_stages"): 0,
            (start.preflight, "transaction_topic_problem"): None, (start.lost_data, "check_stored_offsets"): {},
            (start.preflight, "prepared_parts"): (True, "")}
        names = {"resolve": "resolve_parts"}
        for (owner, attribute), result in steps.items():
            monkeypatch.setattr(owner, attribute, self._step(names.get(attribute, attribute), result))
        monkeypatch.setattr(start, "stop_requested", self._stop_requested)
        monkeypatch.setattr(start, "emit", lambda event, **_: self.names.append(f"emit:{event}"))
        monkeypatch.setattr(start, "OffsetsStore", lambda *_: SimpleNamespace(load=self._step("load_offsets", {})))
        monkeypatch.setattr(start, "Driver", self._step("Driver", "driver"))

    def _step(self, name: str, result: Any) -> Any:
        def step(*_: Any, **__: Any) -> Any:
            self.names.append(name)
            return result
        return step

    def _stop_requested(self, *_: Any) -> str | None:
        self.names.append("stop_requested")
        self.stops += 1
        return "asked" if self.stops == self.stop_at else None


def _claim() -> Any:
    config = SimpleNamespace(postgres=SimpleNamespace(describe=lambda: "db"), pipeline="p", meta_schema="m",
                             ignore_stop_request=False, create_targets=True, target_schema="t",
                             kafka_bootstrap="k", topics=["t"], librdkafka_options=dict)
    spec = SimpleNamespace(subscription=lambda topics: None, transaction_topic=lambda: None)

    @contextmanager
    def cursor() -> Any:
        yield None

    control = SimpleNamespace(autocommit=False, cursor=cursor)
    conn = SimpleNamespace(rollback=lambda: None)
    laps = SimpleNamespace(lap=lambda name: 0, laps={})
    return start._claim(config, spec, SimpleNamespace(stores_offsets=True), "run", laps,  # type: ignore[arg-type]
                        conn, SimpleNamespace(), control)


def test_a_start_takes_its_steps_in_the_protocols_order(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = _Steps(monkeypatch)
    assert _claim() == "driver"
    assert steps.names == PROTOCOL


def test_a_stop_found_first_fences_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = _Steps(monkeypatch, stop_at=1)
    assert _claim() is None
    assert steps.names == [*PROTOCOL[:PROTOCOL.index("stop_requested") + 1], "emit:stopped"]


def test_a_stop_found_under_the_running_lock_touches_no_target(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = _Steps(monkeypatch, stop_at=2)
    assert _claim() is None
    assert steps.names == [*PROTOCOL[:PROTOCOL.index("create_targets")], "emit:stopped"]


def test_a_driver_fenced_while_it_waited_for_the_lock_goes_no_further(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = _Steps(monkeypatch, epoch_now=8)
    with pytest.raises(fencing.Fenced, match="its epoch is 8, this driver got 7"):
        _claim()
    assert steps.names == PROTOCOL[:PROTOCOL.index("current_epoch") + 1]
