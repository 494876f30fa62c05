"""Running the continuous engine until it has applied everything Kafka committed, then stopping it
as StopPipelineOperator does: shared by the engine's tests on ledgers and on mirrors."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg2
from psycopg2 import sql

from spark_apps.eos_stream.sink.offsets_store import OffsetsStore
from spark_apps.eos_stream.state import meta_tables
from spark_apps.ledger.generator import produce_ledger
from tests.helpers.kafka import wait_for_markers
from tests.streaming import AppRun, pg_connect, start_continuous

Partition = tuple[str, int]
# Events per producer session, and the pause between sessions: the production spans the faults.
CHUNK, PAUSE = 300, 0.5


class LedgerProducer(threading.Thread):
    """Produces ``events`` committed ledger events to ``topic`` in sessions of ``CHUNK``
    (transactions of 50, every fourth aborted), numbering them on across sessions from
    ``first_seq`` so the ordering oracle holds; given ``until``, it goes on in sessions of
    ``CHUNK`` until that is set too, so that every kill lands while it writes, however long the
    kills take."""

    def __init__(self, bootstrap: str, topic: str, events: int, first_seq: int = 0,
                 until: threading.Event | None = None) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.events, self.first_seq = bootstrap, topic, events, first_seq
        self.until = until
        self.committed = self.aborted = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.committed < self.events or (self.until is not None and not self.until.is_set()):
                size = min(CHUNK, self.events - self.committed) if self.committed < self.events else CHUNK
                produced = produce_ledger(self.bootstrap, size, topic=self.topic, batch_size=50, abort_every=4,
                                          seed=self.first_seq + self.committed,
                                          first_seq=self.first_seq + self.committed)
                self.committed += produced.committed
                self.aborted += produced.aborted
                time.sleep(PAUSE)
        except BaseException as exc:  # reported by the test
            self.error = exc


def wait_for_batches(run: AppRun, batches: int, timeout: float) -> None:
    """Waits until ``run`` committed ``batches`` cycles, exited, or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.process.poll() is None and len(run.events("batch")) < batches:
        time.sleep(0.01)


def last_stable_offsets(bootstrap: str, topics: list[str]) -> dict[Partition, int]:
    """Every partition's last stable offset, once no transaction is open on ``topics``."""
    from confluent_kafka import IsolationLevel, TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    admin = AdminClient({"bootstrap.servers": bootstrap})
    found: dict[Partition, int] = {}
    for topic in topics:
        wait_for_markers(bootstrap, topic)
        partitions = admin.list_topics(topic, timeout=15).topics[topic].partitions
        futures = admin.list_offsets({TopicPartition(topic, p): OffsetSpec.latest() for p in partitions},
                                     isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=15)
        found.update({(topic, tp.partition): future.result().offset for tp, future in futures.items()})
    return found


def applied_offsets(stack: dict, config: dict, partitions: list[Partition]) -> dict[Partition, int]:
    """Where the pipeline would resume, per partition: the stored offsets (in at_least_once and
    idempotent stored after the rows' commit)."""
    conn = pg_connect(stack)
    try:
        stored = OffsetsStore(config["meta_schema"], config["pipeline"]).load(conn)
    except psycopg2.errors.UndefinedTable:  # a first run that has not created its tables yet
        stored = {}
    finally:
        conn.close()
    return {tp: offset for tp, offset in stored.items() if tp in partitions}


def request_stop(stack: dict, config: dict) -> None:
    """The pipeline's stop request, as StopPipelineOperator sets it."""
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            control = meta_tables.table(config["meta_schema"], meta_tables.CONTROL)
            cur.execute(sql.SQL("UPDATE {} SET stop_requested_at = now() WHERE pipeline = %s").format(control),
                        (config["pipeline"],))
            if cur.rowcount == 0:
                cur.execute(sql.SQL("INSERT INTO {} (pipeline, stop_requested_at) VALUES (%s, now())").format(
                    control), (config["pipeline"],))
    finally:
        conn.close()


def run_until_caught_up(stack: dict, config: dict, tmp_path: Path, topics: list[str], label: str) -> AppRun:
    """Runs the engine until its committed cycles reach every partition's last stable offset,
    then stops it with a stop request; it must exit 0, stopped by that request."""
    run = start_continuous(config, tmp_path, label=label)
    stop_when_caught_up(stack, config, run, topics)
    return run


def stop_when_caught_up(stack: dict, config: dict, run: AppRun, topics: list[str]) -> None:
    """Waits until ``run``'s committed cycles reach every partition's last stable offset (it must
    not exit meanwhile), then stops it with a stop request; it must exit 0, stopped by that request."""
    lso = last_stable_offsets(stack["EOS_KAFKA_BOOTSTRAP"], topics)
    deadline = time.monotonic() + 240
    while applied_offsets(stack, config, sorted(lso)) != lso:
        assert time.monotonic() < deadline and run.process.poll() is None, run.log()[-3000:]
        time.sleep(0.5)
    request_stop(stack, config)
    assert run.wait(120) == 0, run.log()[-3000:]
    assert run.events("stopped")[-1]["reason"].startswith("stop requested at")
