"""Which processes used the cores while a pipeline ran: Spark (the app's
process group: spark-submit's JVM and its Python workers), PostgreSQL (every
``postgres`` process: the server's backends) and Kafka's broker.

A sampler thread reads /proc every ``interval`` seconds. The window that
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

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(stat: str) -> float:
    # Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _sample(group: int) -> dict[str, float]:
    """CPU seconds so far of the processes alive now, by owner (exited ones no longer count:
    the sampler's interval keeps that loss to short-lived processes)."""
    totals = {"spark": 0.0, "postgres": 0.0, "kafka": 0.0, "other": 0.0}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            pgid = int(stat[stat.rindex(")") + 2:].split()[2])
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            owner = "spark" if pgid == group else "postgres" if comm == "postgres" else "other"
            if owner == "other" and comm == "java" and b"kafka.Kafka" in (entry / "cmdline").read_bytes():
                owner = "kafka"
            totals[owner] += _cpu_seconds(stat)
        except (OSError, ValueError, IndexError):
            continue  # the process ended between the listing and the read
    return totals


class CpuShare:
    """Samples while the app of process group ``group`` runs; ``result()`` gives each
    owner's share of all cores over the warm window, and the window's length.

    :param group: the app's process group (``start_new_session``: its leader's pid).
    :param log_path: the app's log; the window opens at its first ``EOS-BATCH`` line.
    """

    def __init__(self, group: int, log_path: Path, interval: float = 0.25) -> None:
        self._group, self._log_path, self._interval = group, log_path, interval
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
            now = (time.monotonic(), _sample(self._group))
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
