"""The stream supervisor's decision after each run (airflow_provider_eos/operators/supervision.py):
every row of next_step's table, and how a run's exit and events map to an outcome."""

from __future__ import annotations

import pytest

from airflow_provider_eos.hooks.stream_submit import AppRunResult
from airflow_provider_eos.operators.supervision import (
    NOT_LOOKED,
    Counters,
    End,
    Fail,
    FailKind,
    Look,
    Looked,
    Outcome,
    Probe,
    Restart,
    RestartPolicy,
    next_step,
    run_outcome,
)

POLICY = RestartPolicy(max_restarts=2, max_fenced_restarts=3, restart_backoff=5.0, max_backoff=12.0)
FRESH = Counters()
HOLD = "a stop was requested at 2026-01-01T00:00:00"
DRIVER = {"pid": 4242, "application_name": "eos-stream"}
NOTHING_HOLDS = Looked(hold=None)
NO_OTHER = Looked(hold=None, other_driver=None)

# (case, outcome, counters, looked, expected step): one row per branch of next_step, in its order.
TABLE = [
    ("killed", Outcome.KILLED, FRESH, Looked(), Fail(FailKind.KILLED)),
    ("killed while held: still killed", Outcome.KILLED, FRESH, Looked(hold=HOLD), Fail(FailKind.KILLED)),
    ("finished", Outcome.FINISHED, FRESH, Looked(), End("finished")),
    ("stopped", Outcome.STOPPED, FRESH, Looked(), End("stopped")),
    ("finished with restarts used up", Outcome.FINISHED, Counters(2, 3), Looked(), End("finished")),
    ("config refused", Outcome.CONFIG_ERROR, FRESH, Looked(), Fail(FailKind.CONFIG)),
    ("config refused under a stop", Outcome.CONFIG_ERROR, FRESH, Looked(hold=HOLD), Fail(FailKind.CONFIG)),
    ("data lost", Outcome.DATA_LOST, FRESH, Looked(), Fail(FailKind.DATA_LOST)),
    ("data lost under a stop", Outcome.DATA_LOST, FRESH, Looked(hold=HOLD), Fail(FailKind.DATA_LOST)),
    ("data lost with restarts left", Outcome.DATA_LOST, FRESH, NO_OTHER, Fail(FailKind.DATA_LOST)),
    ("failed: look for a hold first", Outcome.FAILED, FRESH, Looked(), Look(Probe.HOLD)),
    ("fenced: look for a hold first", Outcome.FENCED, FRESH, Looked(), Look(Probe.HOLD)),
    ("failed while held", Outcome.FAILED, FRESH, Looked(hold=HOLD), End("stopped", held=HOLD)),
    ("fenced while held", Outcome.FENCED, FRESH, Looked(hold=HOLD), End("stopped", held=HOLD)),
    ("failed while held, restarts used up", Outcome.FAILED, Counters(2, 0), Looked(hold=HOLD),
     End("stopped", held=HOLD)),
    ("fenced: then look for another driver", Outcome.FENCED, FRESH, NOTHING_HOLDS, Look(Probe.OTHER_DRIVER)),
    ("fenced, another driver took over", Outcome.FENCED, FRESH, Looked(hold=None, other_driver=DRIVER),
     Fail(FailKind.TAKEN_OVER, other_driver=DRIVER)),
    ("fenced, fenced restarts used up", Outcome.FENCED, Counters(0, 3), NO_OTHER, Fail(FailKind.FENCED_EXHAUSTED)),
    ("fenced: restart at once", Outcome.FENCED, Counters(0, 2), NO_OTHER, Restart(Counters(0, 3), delay=0.0)),
    ("fenced with failure restarts used up: still at once", Outcome.FENCED, Counters(2, 0), NO_OTHER,
     Restart(Counters(2, 1), delay=0.0)),
    ("failed, restarts used up", Outcome.FAILED, Counters(2, 0), NOTHING_HOLDS, Fail(FailKind.RESTARTS_EXHAUSTED)),
    ("failed: first restart after the backoff", Outcome.FAILED, FRESH, NOTHING_HOLDS,
     Restart(Counters(1, 0), delay=5.0)),
    ("failed: second restart, backoff doubled", Outcome.FAILED, Counters(1, 3), NOTHING_HOLDS,
     Restart(Counters(2, 3), delay=10.0)),
    ("failed with fenced restarts used up: still backs off", Outcome.FAILED, Counters(0, 3), NOTHING_HOLDS,
     Restart(Counters(1, 3), delay=5.0)),
]


@pytest.mark.parametrize(("outcome", "counters", "looked", "expected"), [row[1:] for row in TABLE],
                         ids=[row[0] for row in TABLE])
def test_next_step(outcome, counters, looked, expected):
    assert next_step(outcome, counters, POLICY, looked) == expected


def test_the_table_covers_every_outcome_and_every_kind_of_step():
    assert {row[1] for row in TABLE} == set(Outcome)
    assert {row[4].kind for row in TABLE if isinstance(row[4], Fail)} == set(FailKind)
    assert {row[4].probe for row in TABLE if isinstance(row[4], Look)} == set(Probe)
    assert {type(row[4]) for row in TABLE} == {End, Fail, Look, Restart}


def test_no_restarts_allowed_fails_the_first_failure_and_the_first_fence():
    never = RestartPolicy(max_restarts=0, max_fenced_restarts=0, restart_backoff=1.0, max_backoff=1.0)
    assert next_step(Outcome.FAILED, FRESH, never, NOTHING_HOLDS) == Fail(FailKind.RESTARTS_EXHAUSTED)
    assert next_step(Outcome.FENCED, FRESH, never, NO_OTHER) == Fail(FailKind.FENCED_EXHAUSTED)


def test_the_backoff_doubles_up_to_its_cap():
    assert [POLICY.backoff(n) for n in (1, 2, 3, 4)] == [5.0, 10.0, 12.0, 12.0]
    assert next_step(Outcome.FAILED, Counters(2, 0), RestartPolicy(5, 0, 5.0, 12.0), NOTHING_HOLDS) == Restart(
        Counters(3, 0), delay=12.0)


def test_looking_fills_one_answer_at_a_time():
    looked = Looked().having(Probe.HOLD, None)
    assert looked == Looked(hold=None, other_driver=NOT_LOOKED)
    assert looked.having(Probe.OTHER_DRIVER, DRIVER) == Looked(hold=None, other_driver=DRIVER)


STOPPED = ("stopped", {"reason": "stop requested"})

# (case, result, killed, outcome): how one run's exit and EOS- events map to an outcome.
OUTCOMES = [
    ("exit 0", AppRunResult(0), False, Outcome.FINISHED),
    ("exit 0 after a stop", AppRunResult(0, [STOPPED]), False, Outcome.STOPPED),
    ("killed wins over exit 0", AppRunResult(0), True, Outcome.KILLED),
    ("killed wins over a fence", AppRunResult(3), True, Outcome.KILLED),
    ("exit 2", AppRunResult(2), False, Outcome.CONFIG_ERROR),
    ("a config error event", AppRunResult(1, [("error", {"kind": "config"})]), False, Outcome.CONFIG_ERROR),
    ("exit 4", AppRunResult(4), False, Outcome.DATA_LOST),
    ("a data_lost error event", AppRunResult(1, [("error", {"kind": "data_lost", "message": "t-0: stored 5, "
                                                            "log starts at 9"})]), False, Outcome.DATA_LOST),
    ("exit 3", AppRunResult(3), False, Outcome.FENCED),
    ("a fenced error event", AppRunResult(1, [("error", {"kind": "fenced"})]), False, Outcome.FENCED),
    ("exit 1", AppRunResult(1, [("error", {"kind": "failed", "message": "boom"})]), False, Outcome.FAILED),
    ("a signal", AppRunResult(-9), False, Outcome.FAILED),
    ("an unknown exit", AppRunResult(7), False, Outcome.FAILED),
    ("an error event under exit 0 is not a failure", AppRunResult(0, [("error", {"kind": "data_lost"})]), False,
     Outcome.FINISHED),
]


@pytest.mark.parametrize(("result", "killed", "outcome"), [row[1:] for row in OUTCOMES],
                         ids=[row[0] for row in OUTCOMES])
def test_run_outcome(result, killed, outcome):
    assert run_outcome(result, killed) is outcome


def test_a_data_lost_run_says_so():
    assert AppRunResult(4).reason() == "data lost (exit 4): no EOS-ERROR line"
    lost = AppRunResult(1, [("error", {"kind": "data_lost", "message": "t-0: stored 5, log starts at 9"})])
    assert lost.reason() == "exit 1: data_lost: t-0: stored 5, log starts at 9"
    assert not lost.fenced and not lost.config_error
