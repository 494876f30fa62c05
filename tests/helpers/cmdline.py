"""Watching every process's command line for secrets while a test runs."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

EXECUTOR_CLASS = "CoarseGrainedExecutorBackend"
_APP_ID = re.compile(r"--app-id (\S+)")


class CmdlineWatch(threading.Thread):
    """Reads ``/proc/<pid>/cmdline`` of every process every ``interval`` seconds; keeps the hits
    and what it saw. A process that lives shorter than ``interval`` can slip between two reads.

    :param needles: label -> secret; a hit names the label and where it stood, never the secret.
    :param executor_marker: counts only Spark executors whose command line holds it (e.g. the
        worker's ``spark://Worker@host:port``), so another cluster on the machine does not count.
    """

    def __init__(self, needles: dict[str, str], executor_marker: str | None = None, interval: float = 0.3) -> None:
        super().__init__(daemon=True)
        empty = [label for label, needle in needles.items() if not needle]
        if empty:
            raise ValueError(f"empty needle(s) {empty}: they would match every command line")
        self.needles = needles
        self.executor_marker = executor_marker
        self.interval = interval
        self.hits: list[tuple[str, int, str]] = []
        self.executors: set[int] = set()
        self.executor_apps: set[str] = set()
        self.seen = 0
        self.done = threading.Event()

    def scan(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            self.seen += 1
            if EXECUTOR_CLASS in cmdline and (self.executor_marker is None or self.executor_marker in cmdline):
                self.executors.add(int(entry.name))
                app = _APP_ID.search(cmdline)
                if app:
                    self.executor_apps.add(app.group(1))
            for label, needle in self.needles.items():
                if needle in cmdline:
                    # Where it was, never the secret itself: a failure's message must not leak it.
                    at = cmdline.index(needle)
                    self.hits.append((label, int(entry.name), cmdline[max(0, at - 200):at] + f"<{label}>"))

    def run(self) -> None:
        while not self.done.is_set():
            self.scan()
            self.done.wait(self.interval)

    def stop(self) -> None:
        self.done.set()
        self.join(10)
