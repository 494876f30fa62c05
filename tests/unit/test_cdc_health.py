"""The verdicts on a CDC source: a connector's and its tasks' states, a replication slot's WAL."""

from __future__ import annotations

from airflow_provider_eos.hooks.kafka_connect import _connect_value
from airflow_provider_eos.utils.cdc_health import (
    SlotState,
    connector_problems,
    human_bytes,
    shortened_trace,
    slot_problems,
)

TRACE = "org.apache.kafka.connect.errors.ConnectException: boom\n" + "\n".join(
    f"\tat io.debezium.Frame{i}(Frame.java:{i})" for i in range(30))


def status(connector: str = "RUNNING", *tasks: dict) -> dict:
    return {"name": "src", "connector": {"state": connector, "worker_id": "w1:8083"}, "tasks": list(tasks)}


def task(task_id: int, state: str, trace: str | None = None) -> dict:
    return {"id": task_id, "state": state, "worker_id": "w1:8083", **({"trace": trace} if trace else {})}


def test_all_running_is_healthy() -> None:
    assert connector_problems("src", status("RUNNING", task(0, "RUNNING"), task(1, "RUNNING"))) == []


def test_failed_task_names_connector_task_and_trace() -> None:
    [problem] = connector_problems("src", status("RUNNING", task(0, "RUNNING"), task(1, "FAILED", TRACE)))
    assert problem.startswith("task 1 of connector 'src' is FAILED on worker w1:8083:")
    assert "ConnectException: boom" in problem
    assert "Frame10(" in problem and "Frame11(" not in problem  # the trace is shortened
    assert "19 more lines" in problem


def test_paused_connector_and_unassigned_task_are_named_with_their_state() -> None:
    problems = connector_problems("src", status("PAUSED", task(0, "UNASSIGNED")))
    assert problems == ["connector 'src' is PAUSED on worker w1:8083, not RUNNING",
                        "task 0 of connector 'src' is UNASSIGNED on worker w1:8083, not RUNNING"]


def test_running_connector_without_tasks_is_a_problem() -> None:
    [problem] = connector_problems("src", status("RUNNING"))
    assert "'src' is RUNNING but has no task" in problem


def test_shortened_trace_keeps_a_short_trace_whole() -> None:
    assert shortened_trace("a\nb") == "a\nb"
    assert shortened_trace(None) == "(no trace)"


def slot(held: int, age: float | None, wal_status: str = "reserved") -> SlotState:
    return SlotState("dbz", "eos_source", "pgoutput", False, held, held, age, wal_status)


def test_slot_within_thresholds_is_healthy() -> None:
    assert slot_problems(slot(1000, 10.0), "dbz", max_held_bytes=1000, max_age_seconds=10.0) == []


def test_slot_holding_too_many_bytes_names_slot_and_bytes() -> None:
    [problem] = slot_problems(slot(5 * 1024**2, 3.0), "dbz", max_held_bytes=1024**2, max_age_seconds=60)
    assert "replication slot 'dbz' holds back 5242880 bytes (5.0 MiB)" in problem
    assert "oldest ~3s old" in problem and "no consumer is attached" in problem
    assert "more than the 1048576 bytes (1.0 MiB) allowed" in problem


def test_slot_too_old_names_its_age_and_unknown_age_is_not_judged() -> None:
    [problem] = slot_problems(slot(10, 7200.0), "dbz", max_held_bytes=1024, max_age_seconds=3600)
    assert "oldest ~7200s old" in problem and "older than the 3600s allowed" in problem
    assert slot_problems(slot(10, None), "dbz", max_held_bytes=1024, max_age_seconds=3600) == []
    assert slot_problems(slot(10, 7200.0), "dbz", max_held_bytes=1024, max_age_seconds=None) == []


def test_missing_and_lost_slots_are_problems() -> None:
    [missing] = slot_problems(None, "dbz", max_held_bytes=1, max_age_seconds=None)
    assert "replication slot 'dbz' does not exist" in missing
    [lost] = slot_problems(slot(0, 0.0, "lost"), "dbz", max_held_bytes=1, max_age_seconds=None)
    assert "has lost WAL" in lost


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1536, 3 * 1024**3)] == ["0 B", "1023 B", "1.5 KiB", "3.0 GiB"]


def test_connect_values_are_strings_as_connect_stores_them() -> None:
    assert [_connect_value(v) for v in (True, 3, ["a", "b"], 1.5)] == ["true", "3", "a,b", "1.5"]
