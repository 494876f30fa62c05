"""The recovery lock: one recovery of a target at a time, across workers and crashes; and the
target's key, from which the lock row, the scratch databases' names and the swap lock derive.

A row keyed by ``database/target_schema/pipeline`` in ``{meta_schema}.recovery_locks``
holds the DAG run id that owns the target's recovery. Every lock-guarded step
re-acquires it (re-entrant for its own run, so a cleared or rerun task goes on),
refreshes its heartbeat from a background thread while it works, and fails if
another run took the lock over (fencing a run that was presumed dead).

A run whose worker dies without the teardown that releases the lock leaves the
row behind; once its heartbeat is older than the TTL, the next run takes it over.

Failure transitions:

* lock held by another live run (fresh heartbeat): the step fails with
  :class:`RecoveryLockedError`, nothing is touched;
* lock left by a dead run (stale heartbeat): taken over, logged with the dead holder;
* lock taken from this run while a step works (it was presumed dead): the step
  fails when its work ends, so the run does not go on as a zombie;
* the heartbeat cannot reach the database: logged, retried at the next beat;
  the TTL is several beats long.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from airflow.sdk.exceptions import AirflowException

DEFAULT_LOCK_TTL = 900.0  # seconds without a heartbeat before a lock counts as abandoned
BEATS_PER_TTL = 4

log = logging.getLogger(__name__)


class RecoveryLockedError(AirflowException):
    """Another recovery holds the lock for this target."""


def target_lock_key(dbname: str, target_schema: str, pipeline: str) -> str:
    """The key of one restore target: recovery lock row, scratch names and swap lock derive from it."""
    return f"{dbname}/{target_schema}/{pipeline}"


def swap_lock_key(target_key: str) -> str:
    """Advisory lock key: snapshots take it shared (session), a swap exclusively (transaction)."""
    return "eos:swap:" + target_key


def take_lock(hook: Any, key: str, holder: str, ttl: float) -> dict[str, Any]:
    """Acquires (or re-enters) the lock or raises :class:`RecoveryLockedError`.

    :param hook: an ``EosPostgresHook`` built for the pipeline's meta schema (the lock row lives there)."""
    result = hook.acquire_lock(key, holder, ttl)
    if not result["acquired"]:
        raise RecoveryLockedError(
            f"another recovery of {key} is running (lock held by {result['holder']} since {result['acquired_at']}, "
            f"last heartbeat {result['heartbeat_at']}; a lock without heartbeat for {ttl:g}s is taken over)"
        )
    if result.get("taken_over_from"):
        log.warning("recovery lock %s taken over from %s: its heartbeat was older than %gs",
                    key, result["taken_over_from"], ttl)
    return result


@contextmanager
def holding_lock(hook: Any, key: str, holder: str, ttl: float) -> Iterator[dict[str, Any]]:
    """Holds the lock for the duration of a step, heartbeating every ``ttl / 4`` seconds."""
    result = take_lock(hook, key, holder, ttl)
    stop = threading.Event()
    lost: list[str] = []

    def beat() -> None:
        while not stop.wait(ttl / BEATS_PER_TTL):
            try:
                if not hook.heartbeat_lock(key, holder):
                    lost.append(key)
                    return
            except Exception as exc:  # a missed beat is retried; the TTL spans several
                log.warning("recovery lock heartbeat for %s failed: %s", key, exc)

    thread = threading.Thread(target=beat, name=f"eos-lock-heartbeat-{key}", daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join(timeout=5)
    if lost or not hook.heartbeat_lock(key, holder):
        raise RecoveryLockedError(
            f"recovery lock {key} was taken over by another run while this step worked "
            f"(this run was presumed dead); its result must not be trusted"
        )
