"""Small helpers around the real local Kafka broker for integration tests, and a consumed
record as confluent-kafka hands it out, for unit tests of what reads records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import IsolationLevel, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

ROOT = Path(__file__).resolve().parents[2]


def kafka_conn_uri_env(conn_id: str, bootstrap: str) -> tuple[str, str]:
    """(env var name, value) defining an Airflow ``kafka`` connection."""
    value = json.dumps({"conn_type": "kafka", "extra": {"bootstrap.servers": bootstrap}})
    return f"AIRFLOW_CONN_{conn_id.upper()}", value


def create_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(topic, partitions, 1)], operation_timeout=30).values():
        fut.result(30)


def delete_topics(bootstrap: str, *topics: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.delete_topics(list(topics), operation_timeout=30).values():
        try:
            fut.result(30)
        except Exception:
            pass


def wait_for_markers(bootstrap: str, topic: str, timeout: float = 30.0) -> None:
    """Wait until every partition's last stable offset reaches its high watermark.

    A producer's commit or abort returns once the coordinator has logged the decision; the
    markers reach the partitions a moment later. Call this only when no transaction should be
    open any more: it raises if one still is after ``timeout``."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions = [TopicPartition(topic, p) for p in admin.list_topics(topic, timeout=15).topics[topic].partitions]
    deadline = time.monotonic() + timeout
    while True:
        ends = []
        for level in (IsolationLevel.READ_UNCOMMITTED, IsolationLevel.READ_COMMITTED):
            futures = admin.list_offsets({tp: OffsetSpec.latest() for tp in partitions}, isolation_level=level,
                                         request_timeout=15)
            ends.append({tp.partition: future.result().offset for tp, future in futures.items()})
        if ends[0] == ends[1]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{topic}: a transaction is still open after {timeout:g}s "
                                 f"(high watermarks {ends[0]}, last stable offsets {ends[1]})")
        time.sleep(0.1)


@contextmanager
def open_transaction(
    bootstrap: str, topic: str, partition: int = 0, count: int = 5, txn_timeout_ms: int = 10_000
) -> Iterator[dict]:
    """Start tests/helpers/txn_producer.py, wait until its transaction holds ``count``
    flushed records, SIGKILL it and yield its ready line (the transaction stays open
    on the broker). The child is always killed on exit."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.helpers.txn_producer",
            bootstrap,
            topic,
            str(partition),
            str(count),
            str(txn_timeout_ms),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        info = json.loads(line) if line else {"ready": False}
        if not info.get("ready"):
            raise RuntimeError(f"transactional producer child failed: {line!r}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        yield info
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@contextmanager
def python_admin_only() -> Iterator[dict]:
    """Within the block, no child process may start (``subprocess``, ``os.system``,
    ``os.posix_spawn``, ``os.fork``: a ``java`` TransactionsCommand would need one), and every
    kafka-python ``KafkaAdminClient`` that starts is counted: yields
    ``{"admin_clients": n, "spawn_attempts": [...]}``."""
    import kafka.admin.client as kafka_admin
    import pytest

    seen: dict = {"admin_clients": 0, "spawn_attempts": []}

    def forbidden(name):
        def spawn(*args, **kwargs):
            seen["spawn_attempts"].append((name, args[:2]))
            raise AssertionError(f"{name} called during a Python-admin-only block: {args[:2]!r}")
        return spawn

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", forbidden("subprocess.Popen"))
        for name in ("system", "posix_spawn", "posix_spawnp", "fork"):
            mp.setattr(os, name, forbidden(f"os.{name}"))
        original_init = kafka_admin.KafkaAdminClient.__init__

        def counting_init(self, **configs):
            seen["admin_clients"] += 1
            original_init(self, **configs)

        mp.setattr(kafka_admin.KafkaAdminClient, "__init__", counting_init)
        yield seen


@dataclass(frozen=True)
class ConsumedMessage:
    """A consumed record as confluent-kafka hands it out (its accessors only), without an error."""

    record: tuple[str, int, int, bytes | None, bytes | None]  # topic, partition, offset, key, value

    def topic(self) -> str:
        return self.record[0]

    def partition(self) -> int:
        return self.record[1]

    def offset(self) -> int:
        return self.record[2]

    def key(self) -> bytes | None:
        return self.record[3]

    def value(self) -> bytes | None:
        return self.record[4]

    def error(self) -> None:
        return None
