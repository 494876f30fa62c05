"""What a stream's supervisor does after each run of the app: a pure function of how the run
ended, the restarts counted so far and the restart policy.

No I/O here. What a decision needs from the database (a stop request or a recovery that holds
the pipeline; another driver on the running lock) :func:`next_step` asks for with a
:class:`Look` step; the operator's loop (:class:`~.stream.StreamingPipelineOperator`) looks,
and asks again with the answer in :class:`Looked`. The loop performs every other step.

Decision table of :func:`next_step`, first matching row wins:

==========================  ===========================  =======================  ============================
the run ended               looked                       counters                 step
==========================  ===========================  =======================  ============================
killed (``on_kill``)                                                              Fail KILLED
exit 0 after a stop                                                               End ``stopped``
exit 0                                                                            End ``finished``
configuration refused                                                             Fail CONFIG
stored data lost                                                                  Fail DATA_LOST
fenced or failed            hold not looked yet                                   Look HOLD
fenced or failed            a stop or recovery holds                              End ``stopped`` (held)
fenced                      other driver not looked yet                           Look OTHER_DRIVER
fenced                      another driver runs                                   Fail TAKEN_OVER
fenced                      no other driver              fenced >= max fenced     Fail FENCED_EXHAUSTED
fenced                      no other driver              fenced < max fenced      Restart at once, fenced + 1
failed (exit 1, a signal)   nothing holds                restarts >= max          Fail RESTARTS_EXHAUSTED
failed (exit 1, a signal)   nothing holds                restarts < max           Restart after the backoff,
                                                                                  restarts + 1
==========================  ===========================  =======================  ============================

Why this order: a clean exit ends the task whatever holds it. A configuration the app refuses
and offsets Kafka no longer holds fail the same way on every retry, so they fail at once, and
under a stop request too (ending "stopped" would hide them until the next start). A stop or a
recovery wins over a fence: it may be the fence's very cause. A fence restarts at once (nothing
is broken; the new driver resumes from the stored offsets) unless another driver took the
pipeline over, and a failure waits its backoff. A restart after a backoff is counted only once
it happens: the loop reads the hold again during the backoff and at its end, and a hold found
then ends the task "stopped" with the restart not counted.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from airflow_provider_eos.launchers.result import AppRunResult
    from spark_apps.eos_stream.run.config import PipelineConfig


class Outcome(enum.Enum):
    """How one run of the app ended, as far as the supervisor's decision goes."""

    FINISHED = "finished"
    STOPPED = "stopped"  # exit 0 after a stop request or the run's time
    KILLED = "killed"  # the task was killed while the run ended
    CONFIG_ERROR = "config_error"  # the app refused its configuration (exit 2)
    DATA_LOST = "data_lost"  # a stored offset Kafka no longer holds (exit 4)
    FENCED = "fenced"  # the database took the target from the driver (exit 3)
    FAILED = "failed"  # anything else: exit 1, a signal, an unknown exit


def run_outcome(result: AppRunResult, killed: bool) -> Outcome:
    """The :class:`Outcome` of one spark-submit of the app.

    :param result: how the run ended (exit status and ``EOS-`` events).
    :param killed: whether the task was killed (``on_kill``) while it ran."""
    if killed:
        return Outcome.KILLED
    if result.ok:
        return Outcome.STOPPED if result.of("stopped") else Outcome.FINISHED
    if result.config_error:
        return Outcome.CONFIG_ERROR
    if result.data_lost:
        return Outcome.DATA_LOST
    return Outcome.FENCED if result.fenced else Outcome.FAILED


class Probe(enum.Enum):
    """What the loop must read from the database before the decision can be made."""

    HOLD = "hold"  # a stop request, or a live recovery of the pipeline's target
    OTHER_DRIVER = "other_driver"  # the driver on the running lock once this run's own is gone


class FailKind(enum.Enum):
    KILLED = "killed"
    CONFIG = "config"
    DATA_LOST = "data_lost"
    TAKEN_OVER = "taken_over"
    FENCED_EXHAUSTED = "fenced_exhausted"
    RESTARTS_EXHAUSTED = "restarts_exhausted"


class _NotLooked(enum.Enum):
    TOKEN = "not looked"


NOT_LOOKED = _NotLooked.TOKEN
Hold = str | None  # why the pipeline must not start (a stop request, a recovery), or None
Driver = dict[str, Any] | None  # the running lock's holder (``running_lock_holder``), or None


@dataclass(frozen=True)
class Counters:
    """Restarts so far: after failures (with backoff) and after fences (at once), counted apart."""

    restarts: int = 0
    fenced_restarts: int = 0


@dataclass(frozen=True)
class RestartPolicy:
    """
    :param max_restarts: restarts after failures before the task fails.
    :param max_fenced_restarts: immediate restarts after fences before the task fails.
    :param restart_backoff: seconds before the first restart after a failure, doubled each time.
    :param max_backoff: upper bound of one backoff.
    """

    max_restarts: int
    max_fenced_restarts: int
    restart_backoff: float
    max_backoff: float

    def backoff(self, restart: int) -> float:
        """Seconds before restart number ``restart`` (1-based)."""
        return min(float(self.max_backoff), self.restart_backoff * 2 ** (restart - 1))


@dataclass(frozen=True)
class Looked:
    """What the loop has read from the database for this decision."""

    hold: Hold | Literal[_NotLooked.TOKEN] = NOT_LOOKED
    other_driver: Driver | Literal[_NotLooked.TOKEN] = NOT_LOOKED

    def having(self, probe: Probe, answer: Any) -> Looked:
        return replace(self, **{probe.value: answer})


@dataclass(frozen=True)
class End:
    """End the task with ``status``; ``held`` says why a failed run is not restarted."""

    status: str
    held: str | None = None


@dataclass(frozen=True)
class Fail:
    """Fail the task; ``other_driver`` is the driver that took the pipeline over (TAKEN_OVER)."""

    kind: FailKind
    other_driver: Driver = None


@dataclass(frozen=True)
class Look:
    """Read ``probe`` from the database, then ask :func:`next_step` again."""

    probe: Probe


@dataclass(frozen=True)
class Restart:
    """Start the app again, with ``counters`` once it starts; ``delay`` 0: at once, else a backoff
    during which a stop or a recovery cancels the restart."""

    counters: Counters
    delay: float = 0.0


Step = End | Fail | Look | Restart


def next_step(outcome: Outcome, counters: Counters, policy: RestartPolicy, looked: Looked = Looked()) -> Step:
    """The supervisor's next step after a run (the module's table, row by row)."""
    if outcome is Outcome.KILLED:
        return Fail(FailKind.KILLED)
    if outcome in (Outcome.FINISHED, Outcome.STOPPED):
        return End(outcome.value)
    if outcome is Outcome.CONFIG_ERROR:
        return Fail(FailKind.CONFIG)
    if outcome is Outcome.DATA_LOST:
        return Fail(FailKind.DATA_LOST)
    if looked.hold is NOT_LOOKED:
        return Look(Probe.HOLD)
    if looked.hold is not None:
        return End("stopped", held=looked.hold)
    if outcome is Outcome.FENCED:
        if looked.other_driver is NOT_LOOKED:
            return Look(Probe.OTHER_DRIVER)
        if looked.other_driver is not None:
            return Fail(FailKind.TAKEN_OVER, other_driver=looked.other_driver)
        if counters.fenced_restarts >= policy.max_fenced_restarts:
            return Fail(FailKind.FENCED_EXHAUSTED)
        return Restart(replace(counters, fenced_restarts=counters.fenced_restarts + 1))
    if counters.restarts >= policy.max_restarts:
        return Fail(FailKind.RESTARTS_EXHAUSTED)
    return Restart(replace(counters, restarts=counters.restarts + 1), delay=policy.backoff(counters.restarts + 1))


# ---------------------------------------------------------------- what the task reports
def attempt_info(attempt: int, result: AppRunResult) -> dict[str, Any]:
    """One attempt's line of the task's summary."""
    batches = result.of("batch")
    starts = result.of("start")
    return {
        "attempt": attempt,
        "returncode": result.returncode,
        "fenced": result.fenced,
        "reason": result.reason(),
        "duration_s": result.duration_s,
        "run_id": starts[-1].get("run_id") if starts else None,
        # The continuous engine's batches arrive folded into one event (launchers.result.EventLog).
        "batches": sum(int(b.get("folded_batches", 1)) for b in batches),
        "rows_applied": sum(int(b.get("applied") or 0) for b in batches),
        "dead_lettered": sum(int(b.get("dead_lettered") or 0) for b in batches),
    }


def exhausted_message(pipeline: str, attempts: list[dict[str, Any]], why: str | None = None) -> str:
    """Why the task gives up, with how each attempt ended."""
    why = why or f"restarts exhausted ({len(attempts) - 1} restarts)"
    lines = [f"pipeline {pipeline!r} failed {len(attempts)} times; {why}. How each attempt ended:"]
    lines += [f"  attempt {a['attempt']} ({a['duration_s']:.0f}s, {a['batches']} batches): {a['reason']}"
              for a in attempts]
    return "\n".join(lines)


def run_summary(config: PipelineConfig, status: str, attempts: list[dict[str, Any]],
                results: list[AppRunResult], counters: Counters) -> dict[str, Any]:
    """The task's XCom: its status, every attempt, and the last batch's end offsets."""
    end_offsets = None
    for result in reversed(results):
        batches = result.of("batch")
        if batches:
            end_offsets = batches[-1].get("end_offsets")
            if isinstance(end_offsets, str):
                end_offsets = json.loads(end_offsets)
            break
    return {
        "pipeline": config.pipeline,
        "engine": config.engine,
        "trigger": config.trigger,
        "delivery": config.delivery,
        "status": status,
        "restarts": counters.restarts,
        "attempts": attempts,
        "batches": sum(a["batches"] for a in attempts),
        "rows_applied": sum(a["rows_applied"] for a in attempts),
        "dead_lettered": sum(a["dead_lettered"] for a in attempts),
        "end_offsets": end_offsets,
        "fenced_restarts": counters.fenced_restarts,
    }
