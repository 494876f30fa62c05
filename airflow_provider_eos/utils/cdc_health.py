"""Verdicts on a change-data-capture source, as pure functions of what was measured: is a Kafka
Connect connector and each of its tasks RUNNING, and how much WAL (and how old) does the
source's replication slot hold back. The hooks measure (Connect's REST API, PostgreSQL's
``pg_replication_slots``); the operators in ``operators/cdc_health.py`` fail with these messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RUNNING = "RUNNING"
# A stuck connector is to be seen hours before the source's disk fills: 1 GiB or one hour of
# held WAL, whichever comes first, unless the deployment says otherwise.
DEFAULT_MAX_HELD_BYTES = 1024**3
DEFAULT_MAX_AGE_SECONDS = 3600.0
# The Airflow connection to Kafka Connect's REST API unless a definition names another.
DEFAULT_KAFKA_CONNECT_CONN_ID = "kafka_connect_default"
# The lines of a FAILED task's Java trace a message keeps: the exception and where it was thrown,
# enough to see the cause (the whole trace is in Connect's status and its worker log).
TRACE_LINES = 12


def shortened_trace(trace: str | None, lines: int = TRACE_LINES) -> str:
    """The first ``lines`` lines of a Java stack trace, noting how many were left out."""
    if not trace:
        return "(no trace)"
    all_lines = trace.strip().splitlines()
    kept = all_lines[:lines]
    if len(all_lines) > lines:
        kept.append(f"... ({len(all_lines) - lines} more lines in the connector's status)")
    return "\n".join(kept)


def _state_problem(what: str, entry: dict[str, Any]) -> str | None:
    state = str(entry.get("state", "UNKNOWN"))
    if state == RUNNING:
        return None
    worker = entry.get("worker_id")
    where = f" on worker {worker}" if worker else ""
    if state == "FAILED":
        return f"{what} is FAILED{where}:\n{shortened_trace(entry.get('trace'))}"
    return f"{what} is {state}{where}, not RUNNING"


def connector_problems(name: str, status: dict[str, Any]) -> list[str]:
    """What is wrong with a connector, from its ``GET /connectors/{name}/status`` answer: the
    connector or a task not RUNNING (FAILED with its trace; PAUSED, STOPPED, UNASSIGNED or
    RESTARTING with its state), or no task at all. Empty when all is RUNNING."""
    problems = []
    connector_problem = _state_problem(f"connector {name!r}", status.get("connector") or {})
    if connector_problem:
        problems.append(connector_problem)
    tasks = sorted(status.get("tasks") or [], key=lambda t: int(t.get("id", 0)))
    if not tasks and not connector_problem:
        problems.append(f"connector {name!r} is RUNNING but has no task (not yet assigned, or its "
                        "configuration produced none)")
    for task in tasks:
        task_problem = _state_problem(f"task {task.get('id')} of connector {name!r}", task)
        if task_problem:
            problems.append(task_problem)
    return problems


def human_bytes(count: float) -> str:
    """``count`` bytes for a person: 1536 -> '1.5 KiB'."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class SlotState:
    """A replication slot as ``pg_replication_slots`` shows it, measured against the current WAL.

    :param held_bytes: WAL the server keeps for the slot: current LSN minus ``restart_lsn``.
    :param unconfirmed_bytes: current LSN minus ``confirmed_flush_lsn``: changes the consumer
        (Debezium) has not yet confirmed.
    :param age_seconds: a lower bound on the age of the oldest WAL it holds: how long ago the
        WAL segment holding ``restart_lsn`` was finished; 0 while that is the current segment;
        None when the check may not read the WAL directory (it needs ``pg_monitor``).
    :param wal_status: ``reserved``, ``extended``, ``unreserved`` or ``lost``.
    """

    slot_name: str
    database: str | None
    plugin: str | None
    active: bool
    held_bytes: int
    unconfirmed_bytes: int | None
    age_seconds: float | None
    wal_status: str | None

    def as_report(self) -> dict[str, Any]:
        return {"slot": self.slot_name, "database": self.database, "plugin": self.plugin, "active": self.active,
                "held_bytes": self.held_bytes, "unconfirmed_bytes": self.unconfirmed_bytes,
                "age_seconds": self.age_seconds, "wal_status": self.wal_status}


def describe_slot(state: SlotState) -> str:
    """One line: what the slot holds, how old it is, whether a consumer is attached."""
    age = "age unknown (needs pg_monitor)" if state.age_seconds is None else f"oldest ~{state.age_seconds:.0f}s old"
    consumer = "a consumer is attached" if state.active else "no consumer is attached"
    return (f"replication slot {state.slot_name!r} holds back {state.held_bytes} bytes "
            f"({human_bytes(state.held_bytes)}) of WAL, {age}; {consumer}")


def slot_problems(state: SlotState | None, slot_name: str, max_held_bytes: int,
                  max_age_seconds: float | None) -> list[str]:
    """What is wrong with a replication slot: missing, its WAL lost, more than ``max_held_bytes``
    held back, or its oldest held WAL older than ``max_age_seconds`` (None: age not judged).
    Empty when the slot is healthy."""
    if state is None:
        return [f"replication slot {slot_name!r} does not exist (the connector has not created it, "
                "or it was dropped: the connector cannot resume from where it was)"]
    problems = []
    if state.wal_status == "lost":
        problems.append(f"replication slot {slot_name!r} has lost WAL it needed (wal_status lost, past "
                        "max_slot_wal_keep_size): the connector must snapshot again")
    if state.held_bytes > max_held_bytes:
        problems.append(f"{describe_slot(state)}: more than the {max_held_bytes} bytes "
                        f"({human_bytes(max_held_bytes)}) allowed")
    if max_age_seconds is not None and state.age_seconds is not None and state.age_seconds > max_age_seconds:
        problems.append(f"{describe_slot(state)}: older than the {max_age_seconds:g}s allowed")
    return problems
