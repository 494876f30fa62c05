"""Running the continuous engine until it has applied everything Kafka committed, then stopping it
as StopPipelineOperator does: shared by the engine's tests on ledgers and on mirrors."""

from __future__ import annotations

import time
from pathlib import Path

from psycopg2 import sql

from spark_apps.eos_stream.sink.offsets_store import OffsetsStore
from spark_apps.eos_stream.state import meta_tables
from tests.helpers.kafka import wait_for_markers
from tests.streaming import AppRun, pg_connect, start_continuous

Partition = tuple[str, int]


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
    """Where the pipeline would resume, per partition: the offsets stored with the rows, or in
    at_least_once the engine's consumer group's committed offsets."""
    if config["delivery"] == "at_least_once":
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"],
                             "group.id": f"eos-continuous-{config['pipeline']}", "enable.auto.commit": False})
        try:
            committed = consumer.committed([TopicPartition(t, p) for t, p in partitions], timeout=15)
        finally:
            consumer.close()
        return {(tp.topic, tp.partition): tp.offset for tp in committed}
    import psycopg2

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
    lso = last_stable_offsets(stack["EOS_KAFKA_BOOTSTRAP"], topics)
    run = start_continuous(config, tmp_path, label=label)
    deadline = time.monotonic() + 240
    while applied_offsets(stack, config, sorted(lso)) != lso:
        assert time.monotonic() < deadline and run.process.poll() is None, run.log()[-3000:]
        time.sleep(0.5)
    request_stop(stack, config)
    assert run.wait(120) == 0, run.log()[-3000:]
    assert run.events("stopped")[-1]["reason"].startswith("stop requested at")
    return run
