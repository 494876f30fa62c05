"""The exactly-once oracle: what Kafka committed against what the database holds.

Reads every committed record (read_committed, up to the last stable offset)
and compares, per partition: the row count, offsets present more than once,
offsets missing (not counting dead-lettered ones), and for each aggregate
target the totals per key recomputed from Kafka.

    python -m spark_apps.eos_stream.audit --config pipeline.json

Prints one JSON report; exits 1 on any mismatch, 0 when exact.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from typing import Any

from psycopg2 import sql

from spark_apps.eos_stream import meta_tables
from spark_apps.eos_stream.config import PipelineConfig, parse_args
from spark_apps.eos_stream.records import RecordError, parse_record
from spark_apps.eos_stream.sink.postgres import connect
from spark_apps.eos_stream.spec import AggregateTarget, PipelineSpec, RowTarget, load_spec

TopicPartition = tuple[str, int]


def committed_records(bootstrap: str, topics: list[str], options: dict[str, str] | None = None):
    """Yields (topic, partition, offset, value) of every committed record up to the LSO,
    and returns the LSO per partition through the generator's ``value``."""
    from confluent_kafka import Consumer, IsolationLevel
    from confluent_kafka import TopicPartition as KafkaTP
    from confluent_kafka.admin import AdminClient, OffsetSpec

    config: dict[str, str | int | float | bool] = {"bootstrap.servers": bootstrap, **(options or {})}
    admin = AdminClient(config)
    metadata = admin.list_topics(timeout=15)
    partitions = [KafkaTP(t, p) for t in topics for p in sorted(metadata.topics[t].partitions)]
    futures = admin.list_offsets({tp: OffsetSpec.latest() for tp in partitions},
                                 isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=30)
    lso = {(tp.topic, tp.partition): futures[tp].result().offset for tp in partitions}
    consumer = Consumer({**config, "group.id": "eos-audit", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "auto.offset.reset": "earliest"})
    try:
        pending = {key for key, end in lso.items() if end > 0}
        consumer.assign([KafkaTP(t, p, -2) for (t, p) in pending])
        while pending:
            message = consumer.poll(1.0)
            if message is None:
                # Markers and aborted records leave no message: ask for the position.
                for t, p in list(pending):
                    position = consumer.position([KafkaTP(t, p)])[0].offset
                    if position >= lso[(t, p)]:
                        pending.discard((t, p))
                continue
            if message.error():
                raise RuntimeError(f"audit read failed: {message.error()}")
            topic, partition, offset = str(message.topic()), int(message.partition() or 0), int(message.offset() or 0)
            key = (topic, partition)
            if offset < lso[key]:
                yield topic, partition, offset, message.value()
            if offset + 1 >= lso[key]:
                pending.discard(key)
    finally:
        consumer.close()
    return lso


def _fetch(conn, query: sql.Composable, params: tuple = ()) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(query, params)
        return cur.fetchall()


def audit(config: PipelineConfig, spec: PipelineSpec) -> dict[str, Any]:
    conn = connect(config.postgres.dsn_kwargs(), describe=config.postgres.describe(), application_name="eos-audit")
    dead = {
        (t, p, o): error
        for t, p, o, error in _fetch(
            conn,
            sql.SQL('SELECT topic, partition, "offset", error FROM {} WHERE pipeline = %s').format(
                meta_tables.table(config.meta_schema, meta_tables.DEAD_LETTERS)
            ),
            (config.pipeline,),
        )
    }
    expected_offsets: dict[TopicPartition, set[int]] = defaultdict(set)
    expected_dead: set[tuple[str, int, int]] = set()
    aggregates = [t for t in spec.targets if isinstance(t, AggregateTarget)]
    expected_totals: list[dict[tuple, Counter]] = [defaultdict(Counter) for _ in aggregates]
    reader = committed_records(config.kafka_bootstrap, config.topics, config.librdkafka_options())
    lso: dict[TopicPartition, int] = {}
    while True:
        try:
            topic, partition, offset, value = next(reader)
        except StopIteration as done:
            lso = done.value
            break
        try:
            record = parse_record(spec, value)
        except RecordError:
            expected_dead.add((topic, partition, offset))
            continue
        if (topic, partition, offset) in dead:
            continue  # valid JSON the database rejected: quarantined, not counted below
        expected_offsets[(topic, partition)].add(offset)
        for index, target in enumerate(aggregates):
            group = tuple(record[k] for k in target.group_by)
            for column, source in target.increments.items():
                expected_totals[index][group][column] += record[source] if source else 1

    partitions: dict[str, dict[str, Any]] = {}
    mismatches: list[str] = []
    for row_target in (t for t in spec.targets if isinstance(t, RowTarget)):
        table = sql.SQL("{}.{}").format(sql.Identifier(config.target_schema), sql.Identifier(row_target.table))
        rows = _fetch(conn, sql.SQL(
            "SELECT kafka_topic, kafka_partition, kafka_offset, count(*) FROM {} GROUP BY 1, 2, 3").format(table))
        present: dict[TopicPartition, Counter] = defaultdict(Counter)
        for topic, partition, offset, count in rows:
            present[(topic, partition)][offset] = count
        for key in sorted(set(lso) | set(present)):
            expected = expected_offsets.get(key, set())
            got = present.get(key, Counter())
            duplicated = sum(c - 1 for c in got.values() if c > 1)
            missing = len(expected - set(got))
            unexpected = len(set(got) - expected)
            name = f"{row_target.table}:{key[0]}:{key[1]}"
            partitions[name] = {
                "expected": len(expected), "rows": sum(got.values()), "duplicated": duplicated,
                "missing": missing, "unexpected": unexpected, "lso": lso.get(key),
                "dead_lettered": sum(1 for (t, p, _o) in dead if (t, p) == key),
            }
            if duplicated or missing or unexpected:
                mismatches.append(name)

    totals: dict[str, Any] = {}
    for index, target in enumerate(aggregates):
        columns = list(target.increments)
        table = sql.SQL("{}.{}").format(sql.Identifier(config.target_schema), sql.Identifier(target.table))
        actual = {
            tuple(row[: len(target.group_by)]): dict(zip(columns, row[len(target.group_by):], strict=True))
            for row in _fetch(conn, sql.SQL("SELECT {}, {} FROM {}").format(
                sql.SQL(", ").join(map(sql.Identifier, target.group_by)),
                sql.SQL(", ").join(map(sql.Identifier, columns)), table))
        }
        wrong = [
            group for group in set(actual) | set(expected_totals[index])
            if any(actual.get(group, {}).get(c, 0) != expected_totals[index].get(group, Counter())[c]
                   for c in columns)
        ]
        totals[target.table] = {
            "keys": len(actual),
            "keys_wrong": len(wrong),
            **{f"expected_{c}": sum(g[c] for g in expected_totals[index].values()) for c in columns},
            **{f"actual_{c}": sum(int(v.get(c) or 0) for v in actual.values()) for c in columns},
        }
        if wrong:
            mismatches.append(target.table)

    missing_dead = sorted(expected_dead - set(dead))
    if missing_dead:
        mismatches.append("dead_letters")
    conn.close()
    summary = {
        "committed_records": sum(len(v) for v in expected_offsets.values()) + len(expected_dead)
        + sum(1 for k in dead if k not in expected_dead),
        "duplicated": sum(p["duplicated"] for p in partitions.values()),
        "missing": sum(p["missing"] for p in partitions.values()),
        "unexpected": sum(p["unexpected"] for p in partitions.values()),
        "dead_lettered": len(dead),
        "malformed_not_quarantined": len(missing_dead),
    }
    return {"pipeline": config.pipeline, "ok": not mismatches, "mismatches": mismatches,
            "summary": summary, "aggregates": totals, "partitions": partitions}


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    report = audit(config, load_spec(config.spec))
    print(json.dumps(report, indent=2, sort_keys=True, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
