"""The oracle of the real-stack mirror tests: every target table against its source table (EXCEPT
ALL both ways, over the source's columns as they are now, a column added mid-stream included),
each aggregate against its GROUP BY over the source; the change topics' last stable offsets and
the pipeline's stored offsets; and the negative control's replay of older changes."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from psycopg2 import sql

from demo.cdc_app import comparable, differences, rows
from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.records.spec import spec_of
from spark_apps.eos_stream.run.config import from_dict
from spark_apps.eos_stream.sink.staging import create_stage, stage_ranges
from tests.helpers.cdc_workload import AGGREGATES, KEYS, target_of
from tests.streaming import pg_connect


def source_columns(conn: Any, schema: str, table: str) -> tuple[str, ...]:
    """The source table's columns now, in order: the mirror must hold every one of them."""
    with conn.cursor() as cur:
        cur.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = %s"
                    " AND table_name = %s ORDER BY ordinal_position", (schema, table))
        return tuple(name for (name,) in cur.fetchall())


def _group_by(conn: Any, schema: str, table: str, group_by: tuple[str, ...], sums: dict[str, str]) -> Counter:
    """Each group's rows and sums (a NULL adds nothing, as in the aggregate target)."""
    columns = [sql.Identifier(c) for c in group_by]
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT {}, count(*), {} FROM {}.{} GROUP BY {}").format(
            sql.SQL(", ").join(columns), sql.SQL(", ").join(sql.SQL("COALESCE(sum({}), 0)").format(sql.Identifier(c))
                                                            for c in sums.values()),
            sql.Identifier(schema), sql.Identifier(table), sql.SQL(", ").join(columns)))
        return Counter(tuple(comparable(v) for v in row) for row in cur.fetchall())


def compare(source_conn: Any, schema: str, target_conn: Any, target_schema: str) -> dict[str, tuple[int, int]]:
    """Per table and aggregate: (source rows or groups, rows that differ)."""
    found = {}
    for table in KEYS:
        columns = source_columns(source_conn, schema, table)
        wanted = rows(source_conn, schema, table, columns)
        found[table] = (sum(wanted.values()), differences(wanted, rows(target_conn, target_schema, target_of(table),
                                                                       columns)))
    for table, target, group_by, sums in AGGREGATES:
        groups = _group_by(source_conn, schema, table, group_by, sums)
        totals = rows(target_conn, target_schema, target, (*group_by, "row_count", *sums))
        found[target] = (sum(groups.values()), differences(groups, totals))
    return found


def high_watermarks(bootstrap: str, topics: list[str]) -> dict[str, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "cdc-mirror-watermarks",
                         "isolation.level": "read_committed"})
    try:
        return {t: int(consumer.get_watermark_offsets(TopicPartition(t, 0), timeout=10)[1]) for t in topics}
    finally:
        consumer.close()


def topics_written(bootstrap: str, topics: list[str]) -> bool:
    """Whether every one of ``topics`` exists and holds a record (a connector's first writes)."""
    try:
        return all(high_watermarks(bootstrap, topics).values())
    except KafkaException:  # not created yet
        return False


def change_counts(bootstrap: str, topic: str, end: int) -> Counter:
    """The topic's records below ``end`` by op, tombstones, and updates that left a TOASTed value unread."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"cdc-mirror-{time.time_ns()}",
                         "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
    consumer.assign([TopicPartition(topic, 0, 0)])
    counts: Counter = Counter()
    try:
        while True:
            message = consumer.poll(5.0)
            offset = -1 if message is None else message.offset()
            if message is None or message.error() or offset is None or offset >= end:
                break
            value = message.value()
            op = "tombstone" if value is None else json.loads(value)["payload"]["op"]
            counts[op] += 1
            counts["unchanged TOAST"] += bool(value and b"__debezium_unavailable_value" in value)
            if offset == end - 1:
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
    spec = spec_of(from_dict(config))  # a mirror section, or the earlier spec "mirror:<file>" read into one
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
        staged = stage_ranges(dsn, spec, config["meta_schema"], name, False, consumer,
                              [kafka_ranges.OffsetRange(t, 0, kafka_ranges.EARLIEST, end) for t, end in ends.items()])
        with conn.cursor() as cur:
            run = spec.mirror.batch_run(cur, stage, target_schema=config["target_schema"],
                                        meta_schema=config["meta_schema"], skip_applied=skip_applied,
                                        groups=staged.groups)
            applied, _ = run(cur, True, False, {"pipeline": config["pipeline"]})
            cur.execute(sql.SQL("DROP TABLE {}").format(stage))
        conn.commit()
        return applied
    finally:
        conn.close()
