"""CPU seconds of each of several apps running at once, their PostgreSQL backends included.

``cdc_together`` runs two mirrors side by side, so the machine's drift falls on both; their
rates then also depend on how the scheduler shares the cores between them. This sampler says
what each one's work was: every ``interval`` seconds it reads /proc and counts, for each label,

- the processes whose command line, or an ancestor's, holds the label (spark-submit's JVM, the
  Python driver, the Python workers; the CPU of reaped children is in their parent's count, so
  workers that end between samples still count);
- the PostgreSQL backends whose client is such a process, matched by the client's TCP port
  (``ss``), each at the CPU it had when last seen: a backend that ends loses at most an
  interval's CPU, on either side alike.

The broker's work for each app is not counted: it serves both from one process. A label is
matched longest first, so ``...r0whole`` never counts the processes of ``...r0wholebaseline``.
Linux only.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Iterable

from bench.common import linear_at
from bench.cpu_share import _TICKS, _processes

_SS_USER = re.compile(r'pid=(\d+)')


def _backend_clients(port: int) -> dict[int, int]:
    """PostgreSQL backend pid -> the pid of its client, for TCP connections to ``port``."""
    listed = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True).stdout
    servers: dict[int, int] = {}  # client port -> backend pid
    clients: dict[int, int] = {}  # client port -> client pid
    for line in listed.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        local, peer, users = fields[2], fields[3], " ".join(fields[4:])
        owner = _SS_USER.search(users)
        if owner is None:
            continue
        local_port, peer_port = int(local.rsplit(":", 1)[1]), int(peer.rsplit(":", 1)[1])
        if local_port == port:
            servers[peer_port] = int(owner.group(1))
        elif peer_port == port:
            clients[local_port] = int(owner.group(1))
    return {backend: clients[client_port] for client_port, backend in servers.items() if client_port in clients}


def _backend_cpu(pid: int) -> float | None:
    """A backend's own CPU seconds (it has no children), or None once it has ended."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


class PairCpu:
    """Samples until :meth:`stop`; :meth:`between` gives each label's CPU seconds in a window.

    :param labels: a substring of each app's command line (its config's path holds its name).
    :param pg_port: PostgreSQL's port; backends of the apps' connections count as theirs.
    """

    def __init__(self, labels: Iterable[str], pg_port: int, interval: float = 0.5) -> None:
        self._labels = sorted(labels, key=len, reverse=True)
        self._pg_port = pg_port
        self._owner: dict[int, str | None] = {}  # pid -> label (None: none), decided once a pid
        self._backends: dict[int, tuple[str, float]] = {}  # backend pid -> (label, CPU when last seen)
        self._unrelated: set[int] = set()  # PostgreSQL processes that serve no labelled app
        self.samples: dict[str, list[tuple[float, float]]] = {label: [] for label in self._labels}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _label_of(self, pid: int, processes: dict[int, tuple[int, str, float]]) -> str | None:
        chain = []
        found: str | None = None
        while pid > 1 and pid in processes and pid not in self._owner:
            chain.append(pid)
            try:
                command = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                command = ""
            found = next((label for label in self._labels if label in command), None)
            if found is not None:
                break
            pid = processes[pid][0]
        else:
            found = self._owner.get(pid)
        for seen in chain:
            self._owner[seen] = found
        return found

    def _sample(self) -> None:
        processes = _processes()
        totals = dict.fromkeys(self._labels, 0.0)
        for pid, (_, comm, cpu) in processes.items():
            if comm == "postgres":
                continue
            # Each living process counts itself; an ended one is in its parent's reaped children's.
            if (label := self._label_of(pid, processes)) is not None:
                totals[label] += cpu
        new_backends = {pid for pid, (_, comm, _) in processes.items()
                        if comm == "postgres" and pid not in self._backends and pid not in self._unrelated}
        if new_backends:
            for backend, client in _backend_clients(self._pg_port).items():
                if backend in new_backends and (label := self._label_of(client, processes)) is not None:
                    self._backends[backend] = (label, 0.0)
            self._unrelated |= new_backends - set(self._backends)
        for backend, (label, last) in list(self._backends.items()):
            now = _backend_cpu(backend)
            if now is not None:
                self._backends[backend] = (label, now)
                last = now
            totals[label] += last
        now = time.time()
        for label, cpu in totals.items():
            self.samples[label].append((now, cpu))

    def _run(self, interval: float) -> None:
        self._sample()
        while not self._done.wait(interval):
            self._sample()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def between(self, label: str, start: float, end: float) -> float:
        """``label``'s CPU seconds from ``start`` to ``end`` (``time.time()``), linear between samples."""
        return linear_at(self.samples[label], end) - linear_at(self.samples[label], start)
