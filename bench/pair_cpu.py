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

The broker's work for each app is not counted: it serves both from one process. PostgreSQL's
processes of no labelled client count as :data:`OTHER`: its own (the WAL writer, the checkpointer,
autovacuum's workers), which serve every client, and a backend whose client was not matched;
:meth:`PairCpu.other_processes` says which of them worked. A label is
matched longest first, so ``...r0whole`` never counts the processes of ``...r0wholebaseline``.
Linux only.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from bench.common import linear_at
from bench.cpu_share import _processes

_SS_USER = re.compile(r'pid=(\d+)')
_TRIES = 10
OTHER = "other PostgreSQL backends"  # the label of PostgreSQL's processes of no labelled client
UNMATCHED = "a client's backend, the client not matched"  # other_processes' title of one


def _backend_clients(port: int) -> dict[int, int]:
    """PostgreSQL backend pid -> the pid of its client, for TCP connections to ``port``."""
    return backend_clients(subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True,
                                          text=True).stdout, port)


def backend_clients(listed: str, port: int) -> dict[int, int]:
    """Server pid -> the pid of its client, from ``ss -tnpH state established``'s lines, for the
    connections to ``port`` whose both ends are listed."""
    servers: list[tuple[int, int]] = []  # (client port, a server process holding the socket)
    clients: dict[int, int] = {}  # client port -> client pid
    for line in listed.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        # A socket just accepted is held by the postmaster too, until it closes its copy: every
        # process listed is one of the connection's ends.
        owners = [int(pid) for pid in _SS_USER.findall(" ".join(fields[4:]))]
        local_port, peer_port = int(fields[2].rsplit(":", 1)[1]), int(fields[3].rsplit(":", 1)[1])
        if local_port == port:
            servers += [(peer_port, pid) for pid in owners]
        elif peer_port == port and owners:
            clients[local_port] = owners[0]
    return {backend: clients[client_port] for client_port, backend in servers if client_port in clients}


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
        # PostgreSQL processes not matched to a labelled client yet: a backend is looked for in
        # ``_TRIES`` samples (its client may not be listed yet), then taken to serve none.
        self._unmatched: dict[int, int] = {}
        self._other_titles: dict[int, tuple[str, float]] = {}  # OTHER's processes: title, CPU when taken
        self.samples: dict[str, list[tuple[float, float]]] = {label: [] for label in [*self._labels, OTHER]}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _label_of(self, pid: int, processes: dict[int, tuple[int, str, float]]) -> str | None:
        chain = []
        found: str | None = None
        while pid > 1 and pid in processes and pid not in self._owner:
            chain.append(pid)
            command = _command_line(pid) or ""
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
        totals = dict.fromkeys([*self._labels, OTHER], 0.0)
        for pid, (_, comm, cpu) in processes.items():
            if comm == "postgres":
                continue
            # Each living process counts itself; an ended one is in its parent's reaped children's.
            if (label := self._label_of(pid, processes)) is not None:
                totals[label] += cpu
        new_backends = {pid for pid, (parent, comm, _) in processes.items()  # the postmaster's children
                        if comm == "postgres" and processes.get(parent, (0, "", 0.0))[1] == "postgres"
                        and pid not in self._backends and self._unmatched.get(pid, 0) < _TRIES}
        if new_backends:
            for backend, client in _backend_clients(self._pg_port).items():
                if backend in new_backends and (label := self._label_of(client, processes)) is not None:
                    self._backends[backend] = (label, 0.0)
            for backend in new_backends - set(self._backends):
                self._unmatched[backend] = self._unmatched.get(backend, 0) + 1
                if self._unmatched[backend] == _TRIES:
                    self._backends[backend] = (OTHER, 0.0)
                    self._other_titles[backend] = (_title(backend), processes[backend][2])
        for backend, (label, last) in list(self._backends.items()):
            if backend in processes:  # a backend reaps no children: its count is its own CPU
                last = processes[backend][2]
                self._backends[backend] = (label, last)
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

    def other_processes(self) -> dict[str, float]:
        """The CPU seconds of :data:`OTHER`'s processes from when each was taken for one to when it
        was last seen, by process title (PostgreSQL's ``postgres: walwriter``, ``postgres:
        autovacuum worker eos``...; :data:`UNMATCHED` for a client's backend), largest first."""
        by_title: dict[str, float] = {}
        for pid, (title, taken) in self._other_titles.items():
            by_title[title] = by_title.get(title, 0.0) + self._backends[pid][1] - taken
        return {title: round(cpu, 2) for title, cpu in sorted(by_title.items(), key=lambda kv: -kv[1]) if cpu >= 0.01}

    def between(self, label: str, start: float, end: float) -> float:
        """``label``'s CPU seconds from ``start`` to ``end`` (``time.time()``), linear between samples."""
        return linear_at(self.samples[label], end) - linear_at(self.samples[label], start)


def _command_line(pid: int, proc: Path = Path("/proc")) -> str | None:
    """A process's command line as /proc gives it (arguments separated by NULs), or None once it has ended."""
    try:
        return (proc / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return None


def _title(pid: int, proc: Path = Path("/proc")) -> str:
    """A PostgreSQL process's title: its kind (``postgres: walwriter``), :data:`UNMATCHED` for a
    client's backend (``postgres: user database host(port) state``)."""
    command = _command_line(pid, proc)
    if command is None:
        return "ended before it was read"
    title = command.replace("\0", " ").strip()
    return UNMATCHED if "(" in title else title
