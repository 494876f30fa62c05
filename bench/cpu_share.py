"""Which processes used the cores while a pipeline ran: Spark (the app's
process group: spark-submit's JVM and its Python workers), PostgreSQL (every
``postgres`` process: the server's backends) and Kafka's broker.

A sampler thread reads /proc every ``interval`` seconds. A process's count
includes the CPU of its children that ended and were reaped (``cutime`` and
``cstime``), so backends and Python workers that come and go inside the
window still count, once: each ended process in its nearest living ancestor.
Spark's processes are the app's descendants, not its process group:
pyspark's daemon puts its workers in a group of their own. The window that
counts starts when the app's log shows its first batch (the warm-up batch,
JVM JIT and Python workers, is done) and ends with the app, so the shares
are those of the warm batches. Linux only.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import linear_at

_TICKS = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command name, CPU seconds of it and its reaped children)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # the process ended between the listing and the read
        # Fields after the command's closing parenthesis: ppid is the 2nd, utime, stime,
        # cutime and cstime the 12th to the 15th.
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = sum(int(value) for value in fields[11:15]) / _TICKS
        found[int(entry.name)] = (int(fields[1]), stat[stat.index("(") + 1:stat.rindex(")")], cpu)
    return found


def _is_kafka(pid: int) -> bool:
    try:
        return b"kafka.Kafka" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (not idle, not waiting for I/O), from /proc/stat."""
    fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / _TICKS


def _sample(app: int) -> dict[str, float]:
    """CPU seconds so far, by owner: the app ``app`` and its descendants, PostgreSQL, Kafka;
    and the whole machine's busy time (``machine``)."""
    processes = _processes()
    totals = {"spark": 0.0, "postgres": 0.0, "kafka": 0.0, "other": 0.0, "machine": _machine_busy()}
    for pid, (_, comm, cpu) in processes.items():
        ancestor, owner = pid, "other"
        while ancestor > 1 and ancestor in processes:
            if ancestor == app:
                owner = "spark"
                break
            ancestor = processes[ancestor][0]
        if owner == "other" and comm == "postgres":
            owner = "postgres"
        elif owner == "other" and comm == "java" and _is_kafka(pid):
            owner = "kafka"
        totals[owner] += cpu
    return totals


class MachineBusy:
    """The whole machine's busy CPU seconds over time, sampled every ``interval`` seconds on
    ``time.time()``'s clock (the app's batch events' clock) until :meth:`stop`; :meth:`between`
    gives the busy seconds within a window. Busy seconds near the cores times the wall clock
    show a run saturated the machine; on a host whose speed drifts they drift with the wall
    clock (measured: 1.84-1.88 times it on 2 cores in every run), so they do not take the drift out."""

    def __init__(self, interval: float = 0.1) -> None:
        self.samples: list[tuple[float, float]] = [(time.time(), _machine_busy())]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._done.wait(interval):
            self.samples.append((time.time(), _machine_busy()))

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.samples.append((time.time(), _machine_busy()))

    def between(self, start: float, end: float) -> float:
        return linear_at(self.samples, end) - linear_at(self.samples, start)


class CpuShare:
    """Samples while the app runs; ``result()`` gives each owner's share of all cores
    over the warm window, and the window's length.

    :param app: the pid of the app's first process (spark-submit).
    :param log_path: the app's log; the window opens at its first ``EOS-BATCH`` line.
    """

    def __init__(self, app: int, log_path: Path, interval: float = 0.25) -> None:
        self._app, self._log_path, self._interval = app, log_path, interval
        self._start: tuple[float, dict[str, float]] | None = None
        self._last: tuple[float, dict[str, float]] | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _warm(self) -> bool:
        try:
            return b"EOS-BATCH " in self._log_path.read_bytes()
        except OSError:
            return False

    def _run(self) -> None:
        while not self._done.wait(self._interval):
            now = (time.monotonic(), _sample(self._app))
            if self._start is None:
                if self._warm():
                    self._start = now
                continue
            if now[1]["spark"] > 0:  # the app still runs: its CPU is still counted
                self._last = now

    def result(self) -> dict[str, Any]:
        self._done.set()
        self._thread.join()
        if self._start is None or self._last is None:
            return {}
        (t0, c0), (t1, c1) = self._start, self._last
        wall, cores = t1 - t0, os.cpu_count() or 1
        shares = {owner: round((c1[owner] - c0[owner]) / (wall * cores), 3) for owner in c0}
        return {"window_seconds": round(wall, 2), "cores": cores, "share_of_cores": shares}
