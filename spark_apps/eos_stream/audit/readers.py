"""The audit's read of Kafka: in worker processes, one per core, or in the audit's own process.

Judging a record (``records.parse_record``) is pure Python, so one process reading a
million records is bound by one core. A big read is dealt out instead: each worker
process (``audit.worker``) reads and judges a share of the partitions, and the parent
merges their partial sides (``audit_kafka.merge_sides``), which is the side one process
reading them all would have built. The parent meanwhile reads the database's side.

Workers are plain child processes (``subprocess``), not ``multiprocessing``: a spawned
child would import the parent's ``__main__`` (an Airflow command's, in a task), and a
daemonic process (some executors' workers) may not start ``multiprocessing`` children.
Each task goes to its worker on stdin, never on a command line (it holds the Kafka
security options). Every worker is killed and reaped on the way out, whatever happened.
"""

from __future__ import annotations

import os
import pickle
import selectors
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from spark_apps.eos_stream.audit.kafka import KafkaSide, ReadTask, merge_sides, read_task
from spark_apps.eos_stream.audit.rules import AuditTimeout, PartitionRange, read_timeout, unfinished_entry
from spark_apps.eos_stream.kafka.partitions import TopicPartition

# Below this many offsets to read, starting workers costs more than it saves.
PARALLEL_MIN_RECORDS = 100_000
# How long past the deadline a worker has to answer: it looks at the deadline between
# batches of records (``audit_kafka.committed_records``), well within this.
ANSWER_GRACE = 15.0
# The worker imports spark_apps from where this process found it.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_WORKER = ("import sys; sys.path.insert(0, {root!r}); "
           "from spark_apps.eos_stream.audit.worker import main; main()")


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def worker_count(ranges: dict[TopicPartition, PartitionRange], workers: int | None) -> int:
    """How many processes read: ``workers`` if given (1: this process alone), else one per
    core when there are ``PARALLEL_MIN_RECORDS`` offsets to read; never more than the
    partitions with offsets to read."""
    busy = sum(1 for r in ranges.values() if r.lso > r.earliest)
    if workers is None:
        workers = cores() if sum(max(0, r.lso - r.earliest) for r in ranges.values()) >= PARALLEL_MIN_RECORDS else 1
    return max(1, min(workers, busy))


def shares(ranges: dict[TopicPartition, PartitionRange], count: int) -> list[dict[TopicPartition, PartitionRange]]:
    """The partitions with offsets to read, dealt to ``count`` workers: the largest first, each
    to the worker with the fewest offsets so far."""
    out: list[dict[TopicPartition, PartitionRange]] = [{} for _ in range(count)]
    load = [0] * count
    for tp, rng in sorted(ranges.items(), key=lambda item: (item[1].earliest - item[1].lso, item[0])):
        if rng.lso > rng.earliest:
            least = load.index(min(load))
            out[least][tp] = rng
            load[least] += rng.lso - rng.earliest
    return [share for share in out if share]


def _pickled(task: ReadTask) -> bytes | None:
    """The task as a pickle, or None when it does not pickle (a spec whose transform is a lambda
    or a local function): such a read stays in this process."""
    try:
        return pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        return None


class KafkaRead:
    """Kafka's side of one audit: started on entering (workers begin reading at once), taken by
    ``side()``, and every worker process gone on leaving.

    :param task: the whole read (every partition).
    :param workers: processes to read with (None: ``worker_count``'s choice; 1: this process).
    """

    def __init__(self, task: ReadTask, workers: int | None = None) -> None:
        self.task = task
        self.workers = worker_count(task.ranges, workers)
        self.procs: list[tuple[subprocess.Popen, dict[TopicPartition, PartitionRange]]] = []

    def __enter__(self) -> KafkaRead:
        if self.workers > 1:
            parts = [ReadTask(**{**vars(self.task), "ranges": share,
                                 "dead": frozenset(k for k in self.task.dead if (k[0], k[1]) in share)})
                     for share in shares(self.task.ranges, self.workers)]
            payloads = [payload for payload in map(_pickled, parts) if payload is not None]
            if len(payloads) == len(parts):
                try:
                    for part, payload in zip(parts, payloads, strict=True):
                        self._start(part.ranges, payload)
                except BaseException:
                    self.stop()
                    raise
        return self

    def _start(self, share: dict[TopicPartition, PartitionRange], payload: bytes) -> None:
        proc = subprocess.Popen([sys.executable, "-c", _WORKER.format(root=_PACKAGE_ROOT)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.procs.append((proc, share))
        assert proc.stdin is not None
        with proc.stdin:
            proc.stdin.write(pickle.dumps(sys.path, protocol=pickle.HIGHEST_PROTOCOL) + payload)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        """Kills every worker still running and reaps them all (a worker holds no state worth
        a clean exit: its consumer commits nothing)."""
        for proc, _share in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def side(self) -> KafkaSide:
        """Kafka's side of every partition.

        :raises AuditTimeout: the deadline passed, naming every partition that did not finish.
        :raises RuntimeError: a worker failed (its error and traceback) or ended without answering."""
        if not self.procs:
            return read_task(self.task)
        answers = _answers(self.procs, self.task.deadline + ANSWER_GRACE)
        sides, unfinished, silent = [], [], []
        for (proc, share), answer in zip(self.procs, answers, strict=True):
            if answer is None:
                silent.append(proc.pid)
                unfinished += [unfinished_entry(tp, rng.earliest, rng.lso) for tp, rng in share.items()]
            elif answer[0] == "ok":
                sides.append(answer[1])
            elif answer[0] == "timeout":
                unfinished += answer[1]
            else:
                raise _worker_error(proc, share, answer)
        if unfinished:
            raise _timed_out(self.task.timeout, unfinished, silent)
        return merge_sides(len(self.task.aggregates), sides)


def _names(share: dict[TopicPartition, PartitionRange]) -> str:
    return ", ".join(f"{t}[{p}]" for t, p in sorted(share))


def _worker_error(proc: subprocess.Popen, share: dict[TopicPartition, PartitionRange], answer: tuple) -> RuntimeError:
    """The error a worker answered, or why it gave no answer."""
    if answer[0] == "error":
        return RuntimeError(f"audit: reading Kafka partitions {_names(share)} failed in worker process {proc.pid}: "
                            f"{answer[1]}\n{answer[2]}")
    return RuntimeError(f"audit: worker process {proc.pid} reading Kafka partitions {_names(share)} "
                        f"{answer[1]} (its stderr is above)")


def _timed_out(timeout: float, unfinished: list[dict], silent: list[int]) -> AuditTimeout:
    """The AuditTimeout of every worker's unfinished partitions; a worker that did not answer at
    all is named, its partitions shown at their start (where they stand is unknown)."""
    error = read_timeout(timeout, unfinished)
    if not silent:
        return error
    return AuditTimeout(f"{error}; worker process(es) {', '.join(map(str, silent))} did not answer within "
                        f"{ANSWER_GRACE:g}s past the deadline and were stopped (their partitions are shown at "
                        "their first offset: how far they got is unknown)", error.unfinished)


def _answers(procs: list[tuple[subprocess.Popen, dict]], until: float) -> list[tuple | None]:
    """Each worker's answer (None: it sent none by ``until``, a ``time.monotonic()`` value), read
    from all of them at once so none waits on a full pipe. The first answer that is neither a
    side nor a timeout ends the wait: the audit fails now, the others' work is of no use."""
    received = {proc.pid: bytearray() for proc, _share in procs}
    answers: dict[int, tuple] = {}
    with selectors.DefaultSelector() as selector:
        for proc, _share in procs:
            assert proc.stdout is not None
            selector.register(proc.stdout, selectors.EVENT_READ, proc)
        while selector.get_map() and time.monotonic() < until:
            for key, _events in selector.select(max(0.0, until - time.monotonic())):
                proc, chunk = key.data, os.read(key.fd, 1 << 20)
                if chunk:
                    received[proc.pid] += chunk
                    continue
                selector.unregister(key.fileobj)
                answers[proc.pid] = _decoded(proc, bytes(received.pop(proc.pid)))
                if answers[proc.pid][0] not in ("ok", "timeout"):
                    return [answers.get(proc.pid) for proc, _share in procs]
    return [answers.get(proc.pid) for proc, _share in procs]


def _decoded(proc: subprocess.Popen, data: bytes) -> tuple:
    """A worker's answer from the bytes it wrote before closing stdout."""
    try:
        return pickle.loads(data)
    except Exception:  # nothing or a torn pickle: the worker died while answering
        try:
            code: int | str = proc.wait(ANSWER_GRACE)
        except subprocess.TimeoutExpired:
            code = "none: still running"
        return "died", f"closed its output without an answer (exit code {code})"
