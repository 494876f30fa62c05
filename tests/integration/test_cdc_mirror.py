"""A mirror pipeline end to end on the real stack: Debezium's PostgreSQL connector on Kafka Connect
publishes three source tables' changes (a composite key, jsonb, numeric(20,6), timestamptz, an
array, a TOASTed text left unchanged by updates, primary-key changes, deletes) while an
application changes them in multi-row transactions; one driver streams all three tables, from a
declarative definition (``spec: "mirror:<file>"``), exactly_once, and is SIGKILLed before its
fourth batch commits. After the workload stops and the stored offsets reach the change topics'
last stable offsets, every target table equals its source table and the aggregate equals its
GROUP BY over the source. Negative control: an older offset range replayed without the stored
offsets' check (what at-least-once does) moves rows back in time, and the same comparison sees it;
replayed with the check, nothing moves."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition
from psycopg2 import sql

from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook
from airflow_provider_eos.utils.debezium_config import postgres_connector_config
from demo.cdc_app import (
    LAST_CHANGES,
    SOURCE_DDL,
    TABLES,
    Workload,
    compare,
    holds_last_changes,
    mirror_definition,
)
from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.records.spec import load_spec
from spark_apps.eos_stream.sink.staging import create_stage, stage_ranges
from tests.helpers.cdc_source import Source, drop_slot, source_connection, wait_until, write_source
from tests.streaming import AppRun, pg_connect, pipeline_config, start_app

CONNECT_CONN = "eos_cdc_mirror_connect"
WORKLOAD_SECONDS = 40


def mirror_connector(env: dict[str, str], schema: str, slot: str) -> dict[str, Any]:
    """The project's connector over the mirror's tables, naming each column's source type (a
    column added mid-stream is then typed by its events)."""
    return postgres_connector_config(env, schema, slot, [f"{schema}.{table}" for table in TABLES],
                                     **{"column.propagate.source.type": ".*"})


def high_watermarks(bootstrap: str, topics: list[str]) -> dict[str, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "cdc-mirror-watermarks",
                         "isolation.level": "read_committed"})
    try:
        return {t: int(consumer.get_watermark_offsets(TopicPartition(t, 0), timeout=10)[1]) for t in topics}
    finally:
        consumer.close()


def change_counts(bootstrap: str, topic: str, end: int) -> Counter:
    """The topic's records below ``end`` by op, tombstones, and updates that left a TOASTed value unread."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"cdc-mirror-{time.time_ns()}",
                         "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
    consumer.assign([TopicPartition(topic, 0, 0)])
    counts: Counter = Counter()
    try:
        while True:
            message = consumer.poll(5.0)
            if message is None or message.error() or message.offset() >= end:
                break
            value = message.value()
            op = "tombstone" if value is None else json.loads(value)["payload"]["op"]
            counts[op] += 1
            counts["unchanged TOAST"] += bool(value and b"__debezium_unavailable_value" in value)
            if message.offset() == end - 1:
                break
    finally:
        consumer.close()
    return counts


def stored_offsets(conn: Any, config: dict[str, Any]) -> dict[str, int]:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT topic, next_offset FROM {}.kafka_offsets WHERE pipeline = %s").format(
            sql.Identifier(config["meta_schema"])), (config["pipeline"],))
        return dict(cur.fetchall())


def replay(stack: dict[str, str], config: dict[str, Any], ends: dict[str, int], skip_applied: bool) -> int:
    """Stages each topic's records below ``ends`` and applies them through the mirror's own
    apply, with or without the stored offsets' check; returns the records it applied."""
    spec = load_spec(config["spec"])
    assert spec.mirror is not None
    conn = pg_connect(stack)
    conn.autocommit = False
    dsn = {"host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]), "dbname": stack["EOS_PG_DB"],
           "user": stack["EOS_PG_USER"], "password": stack["EOS_PG_PASSWORD"]}
    name = f"replay_{int(skip_applied)}"
    try:
        stage = create_stage(conn, spec, config["meta_schema"], name)
        settings = kafka_ranges.consumer_settings(config["kafka_bootstrap"], {}, "cdc-mirror-replay")
        consumer = kafka_ranges.worker_consumer(settings)
        stage_ranges(dsn, spec, config["meta_schema"], name, False, consumer,
                     [kafka_ranges.OffsetRange(t, 0, kafka_ranges.EARLIEST, end) for t, end in ends.items()])
        with conn.cursor() as cur:
            run = spec.mirror.batch_run(cur, stage, target_schema=config["target_schema"],
                                        meta_schema=config["meta_schema"], skip_applied=skip_applied)
            applied, _ = run(cur, True, False, {"pipeline": config["pipeline"]})
            cur.execute(sql.SQL("DROP TABLE {}").format(stage))
        conn.commit()
        return applied
    finally:
        conn.close()


@pytest.mark.timeout(900)
def test_a_mirror_pipeline_equals_its_source_through_a_driver_kill(
        connect: dict[str, str], source: Source, unique_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env, schema = connect, source.schema
    slot, connector = f"dbz_{unique_name}", f"mirror-{unique_name}"
    host, port = env["EOS_CONNECT_URL"].removeprefix("http://").split(":")
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONNECT_CONN.upper()}", json.dumps(
        {"conn_type": "kafka_connect", "host": host, "port": int(port), "schema": "http"}))
    write_source(source, SOURCE_DDL)
    workload = Workload(source_connection(env), schema)
    for _ in range(5):  # rows for the connector's initial snapshot (op 'r')
        workload.transaction()
    definition = tmp_path / "mirror.yaml"
    definition.write_text(json.dumps(mirror_definition(schema, schema), indent=2))  # JSON is YAML
    topics = [f"{schema}.{schema}.{t}" for t in TABLES]
    name = f"mirror_{unique_name}"
    config = pipeline_config(env, tmp_path, name, topics=topics, spec=f"mirror:{definition}",
                             trigger="processingTime", trigger_interval="2 seconds", max_offsets_per_trigger=400)
    hook = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)
    runs: list[AppRun] = []
    thread = threading.Thread(target=workload.run, args=(WORKLOAD_SECONDS,), daemon=True)
    target = pg_connect(env)
    try:
        hook.put_connector_config(connector, mirror_connector(env, schema, slot))
        wait_until(f"{connector} RUNNING", lambda: not hook.connector_problems(connector))

        def topics_written() -> bool:
            try:
                return all(high_watermarks(env["EOS_KAFKA_BOOTSTRAP"], topics).values())
            except KafkaException:  # not created yet
                return False

        wait_until("the change topics", topics_written)
        # The first driver dies by SIGKILL before its fourth batch commits (sink/batch_sink.py's fault
        # points), while the workload runs: it starts once the driver applied the snapshot.
        runs.append(start_app(config, tmp_path, env_extra={"EOS_FAULT_POINT": "before_commit",
                                                           "EOS_FAULT_AT_BATCH": "4"}, label="killed"))
        wait_until("the snapshot applied", lambda: runs[0].events("batch") or runs[0].process.poll() is not None,
                   timeout=300)
        started = time.monotonic()
        thread.start()
        # -9: the app SIGKILLed its own process group (its last line may die with the JVM that relays it).
        assert runs[0].wait(300) == -9, runs[0].log()[-3000:]
        assert len(runs[0].events("batch")) == 3, runs[0].log()[-3000:]
        killed_at = time.monotonic() - started
        assert thread.is_alive(), f"the driver was killed {killed_at:.0f}s in, after the workload"
        runs.append(start_app(config, tmp_path, label="restarted"))
        thread.join(WORKLOAD_SECONDS + 60)
        assert workload.error is None, workload.error
        workload.stop.set()
        # A last transaction on every table: once the mirror holds it, the stream has read past all before it.
        write_source(source, LAST_CHANGES)
        stopped = time.monotonic()

        def caught_up() -> bool:
            assert runs[-1].process.poll() is None, runs[-1].log()[-4000:]
            lso = high_watermarks(env["EOS_KAFKA_BOOTSTRAP"], topics)
            # The offsets alone could be read before the last transaction reached Kafka.
            return stored_offsets(target, config) == lso and holds_last_changes(target, config["target_schema"])

        wait_until("stored offsets at the change topics' last stable offsets", caught_up, timeout=300, interval=2)
        caught_up_after = time.monotonic() - stopped
        runs[-1].kill()
        oracle = compare(source.conn, schema, target, config["target_schema"])
        print(f"oracle (source rows, rows that differ): {oracle}; {workload.transactions} source transactions, "
              f"driver killed at {killed_at:.0f}s, caught up {caught_up_after:.0f}s after the workload stopped")
        assert all(count > 0 and differ == 0 for count, differ in oracle.values()), oracle
        with target.cursor() as cur:
            cur.execute(sql.SQL("SELECT count(*) FROM {}.dead_letters").format(sql.Identifier(config["meta_schema"])))
            assert cur.fetchone() == (0,)
        assert runs[-1].events("resume")[0]["write_path"] == "staged"
        ops = change_counts(env["EOS_KAFKA_BOOTSTRAP"], topics[0], stored_offsets(target, config)[topics[0]])
        print(f"{topics[0]}: {ops}")
        assert ops["unchanged TOAST"] > 0 and ops["d"] > 0 and ops["u"] > 0, ops  # the test saw what it tests

        # Negative control: the first half of each topic again, below the stored offsets.
        half = {t: end // 2 for t, end in stored_offsets(target, config).items()}
        assert replay(env, config, half, skip_applied=True) == 0
        assert compare(source.conn, schema, target, config["target_schema"]) == oracle
        applied = replay(env, config, half, skip_applied=False)
        damaged = compare(source.conn, schema, target, config["target_schema"])
        print(f"replayed {applied} older changes without the offsets' check: {damaged}")
        assert applied > 0 and damaged["customers"][1] > 0 and damaged["order_lines"][1] > 0, damaged
    finally:
        workload.stop.set()
        for run in runs:
            run.kill()
        target.close()
        workload.conn.close()
        hook.delete_connector(connector)
        drop_slot(source, slot)
