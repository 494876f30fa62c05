"""Riding out a lost connection: one bound, one backoff, one error that names what failed.

A PostgreSQL restart, a terminated backend or a broker restart is weather: the driver waits
it out instead of exiting, as long as the outage lasts no more than a bound (the pipeline's
``transient_retry_seconds``, the time one batch may spend on transient errors). Past it, the
run fails with ``OutageTooLong``, whose text names the step that could not go on, where it
could not reach (the database's ``user@host:port/db``, Kafka's bootstrap servers) and the
last cause. Used by the stop-and-fence poll (``control.StopSignal``, which every engine that
polls builds with ``Driver.stop_signal``) and by every session of the continuous engine
(``engines/continuous.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# The first wait after a failure, doubled after each further one up to the cap. The cap is short:
# a continuous pipeline's records wait for the first success after the outage, so the retries
# must come often; each costs one connection attempt.
FIRST_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 5.0


class OutageTooLong(RuntimeError):
    """A step could not reach a service for longer than its bound (retryable: a supervisor
    restarts the run, which claims again)."""

    def __init__(self, step: str, where: str, seconds: float, cause: BaseException) -> None:
        self.step, self.where = step, where
        super().__init__(f"step {step!r} could not reach {where} for {seconds:.0f} s, past its bound "
                         f"(transient_retry_seconds): {type(cause).__name__}: {' '.join(str(cause).split())[:500]}")


def backoff_seconds(failures: int, first: float = FIRST_BACKOFF_SECONDS, cap: float = MAX_BACKOFF_SECONDS) -> float:
    """The wait after the ``failures``-th failure in a row (1: the first): ``first`` doubled
    each time, never more than ``cap``."""
    return min(first * 2 ** max(failures - 1, 0), cap)


class Outage:
    """How long a step has gone on failing with transient errors, and whether that passed
    ``bound_seconds``: ``failed`` raises ``OutageTooLong`` then, and ``ok`` ends the outage.

    :param step: what the failures keep from going on (the error names it).
    :param where: the service it cannot reach (the error names it).
    """

    def __init__(self, step: str, where: str, bound_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.step, self.where, self.bound_seconds, self.clock = step, where, bound_seconds, clock
        self.since: float | None = None
        self.failures = 0

    def ok(self) -> None:
        self.since, self.failures = None, 0

    def failed(self, exc: BaseException) -> float:
        """Counts one failure; returns the wait before the next try, or raises ``OutageTooLong``
        (from ``exc``) once the outage lasted more than the bound."""
        now = self.clock()
        if self.since is None:
            self.since = now
        self.failures += 1
        if now - self.since > self.bound_seconds:
            raise OutageTooLong(self.step, self.where, now - self.since, exc) from exc
        return backoff_seconds(self.failures)


def call_through(step: str, where: str, bound_seconds: float, call: Callable[[], T], *,
                 transient: Callable[[BaseException], bool],
                 sleep: Callable[[float], Any] = time.sleep,
                 on_retry: Callable[[BaseException, float], Any] | None = None) -> T:
    """``call()``'s result, calling it again after each transient failure with backoff
    (``sleep``, which may raise to end the wait early: a stop) until the outage lasts more
    than ``bound_seconds`` (``OutageTooLong``). Any other error raises at once.

    :param transient: whether an error is weather (``errors.classify``'s "transient": a lost
        connection, a lock or statement timeout, a shutdown), worth waiting out.
    :param on_retry: told ``(error, wait)`` before each wait."""
    outage = Outage(step, where, bound_seconds)
    while True:
        try:
            return call()
        except Exception as exc:
            if not transient(exc):
                raise
            wait = outage.failed(exc)
            if on_retry is not None:
                on_retry(exc, wait)
            sleep(wait)


def describe_connection(conn: Any) -> str:
    """``PostgreSQL user@host:port/db`` of an open psycopg2 connection (for an error's text)."""
    try:
        info = conn.info
        return f"PostgreSQL {info.user}@{info.host}:{info.port}/{info.dbname}"
    except Exception:  # a mock, or a connection already closed
        return "PostgreSQL"
