"""A mirror by pattern end to end on the real stack: Debezium's PostgreSQL connector (schemas on,
``column.propagate.source.type``) captures every table of a source schema; the mirror's definition
names them by one ``source_pattern`` and lists none, so each target is created from the change
events' schemas. An application changes two tables (a composite key, numeric, varchar(n),
timestamptz), and once the driver streams, creates a third table, which Debezium publishes to a
topic that did not exist when the driver subscribed: the driver reads it from its first offset.
A first driver is SIGKILLed after its first batch's apply, before the commit: the targets that
batch created are gone with its rows and offsets, and the next driver creates them again.
After the workload stops and the stored offsets reach every change topic's last stable offset,
every target equals its source (EXCEPT ALL both ways: 0 rows), with the source's key, and the
late table's text[], jsonb, date, bytea and time columns typed from its events."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg2 import sql

from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook
from airflow_provider_eos.utils.debezium_config import postgres_connector_config
from bench.harness import kafka_connect_connection
from tests.helpers.cdc_source import Source, drop_slot, wait_until, write_source
from tests.streaming import AppRun, pg_connect, pipeline_config, start_app

CONNECT_CONN = "eos_cdc_pattern_connect"
FIRST_TABLES = {"stock": ("warehouse", "sku"), "bins": ("id",)}
LATE_TABLE = "late_notes"  # the statements below name it as it is
SOURCE_DDL = [
    "CREATE TABLE stock (warehouse integer, sku varchar(40), qty bigint NOT NULL, price numeric(12,2),"
    " PRIMARY KEY (warehouse, sku))",
    "CREATE TABLE bins (id bigint PRIMARY KEY, label text, seen timestamptz)",
]
LATE_DDL = (f"CREATE TABLE {LATE_TABLE} (id bigint PRIMARY KEY, note text, amount numeric(20,6), tags text[],"
            " doc jsonb, born date, blob bytea, wakes time)")


def pattern_connector(env: dict[str, str], schema: str, slot: str) -> dict[str, Any]:
    """Every table of ``schema``, the ones created later too, with each change's schemas."""
    json_converter = "org.apache.kafka.connect.json.JsonConverter"
    return postgres_connector_config(env, schema, slot, [], **{
        "table.include.list": f"{schema}\\..*", "column.propagate.source.type": ".*",
        "key.converter": json_converter, "key.converter.schemas.enable": "true",
        "value.converter": json_converter, "value.converter.schemas.enable": "true"})


def changes(source: Source, rng: random.Random, tables: list[str], round_: int) -> None:
    """One multi-row transaction: inserts, updates (a primary-key change among them) and deletes on ``tables``."""
    wanted: list[tuple[str, tuple | None]] = []
    for n in range(3):
        key = round_ * 10 + n
        if "stock" in tables:
            wanted.append(("INSERT INTO stock VALUES (%s, %s, %s, %s)",
                           (key % 3, f"sku-{key}", rng.randint(1, 99), f"{rng.randint(0, 9999)}.{rng.randint(0, 99)}")))
        if "bins" in tables:
            wanted.append(("INSERT INTO bins VALUES (%s, %s, now() - %s * interval '1 minute')",
                           (key, f"b{key}", key)))
        if LATE_TABLE in tables:
            wanted.append(("INSERT INTO late_notes VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                           (key, f"n{key}", f"{rng.randint(0, 10**9)}.123456", ["a", f"t{key}", None, "b c"],
                            json.dumps({"k": key, "l": [1, None]}), f"2026-01-{key % 28 + 1:02d}",
                            bytes([key % 256, 0, 255]), f"{key % 24:02d}:30:15.123456")))
    if round_ and "stock" in tables:
        wanted += [("UPDATE stock SET qty = qty + 1, price = NULL WHERE sku LIKE %s", ("sku-%1",)),
                   ("DELETE FROM stock WHERE sku = %s", (f"sku-{round_ * 10 - 8}",))]
    if round_ and "bins" in tables:
        wanted += [("UPDATE bins SET id = id + 100000 WHERE id = %s", (round_ * 10 - 9,)),
                   ("UPDATE bins SET label = NULL WHERE id = %s", (round_ * 10 - 8,))]
    if round_ and LATE_TABLE in tables:
        wanted += [("UPDATE late_notes SET note = note || '!' WHERE id % 2 = 0", None),
                   ("DELETE FROM late_notes WHERE id = %s", (round_ * 10 - 10,))]
    with source.conn.cursor() as cur:
        statements = [cur.mogrify(statement, params).decode() for statement, params in wanted]
    write_source(source, statements)


def _text(value: Any) -> str:
    """A value comparable across connections (a bytea arrives as a memoryview)."""
    return bytes(value).hex() if isinstance(value, memoryview) else str(value)


def table_rows(conn: Any, schema: str, table: str) -> Counter:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT * FROM {}.{}").format(sql.Identifier(schema), sql.Identifier(table)))
        names = [d[0] for d in cur.description]
        return Counter(tuple(sorted(zip(names, map(_text, row), strict=True))) for row in cur.fetchall())


def primary_key(conn: Any, schema: str, table: str) -> list[str]:
    with conn.cursor() as cur:
        cur.execute("SELECT a.attname::text FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid"
                    " AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass AND i.indisprimary"
                    " ORDER BY array_position(i.indkey::int[], a.attnum::int)",
                    (sql.Identifier(schema, table).as_string(conn),))
        return [k for (k,) in cur.fetchall()]


def last_stable_offsets(bootstrap: str, prefix: str) -> dict[str, int]:
    """Every change topic of ``prefix`` and its end (read_committed: the last stable offset). The
    connector's transaction topic (``<prefix>.transaction``, which a per_key mirror does not read)
    is no change topic."""
    topics = sorted(t for t in AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
                    if t.startswith(prefix + ".") and t != f"{prefix}.transaction")
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "cdc-pattern-lso",
                         "isolation.level": "read_committed"})
    try:
        return {t: int(consumer.get_watermark_offsets(TopicPartition(t, 0), timeout=10)[1]) for t in topics}
    finally:
        consumer.close()


def target_tables(conn: Any, schema: str) -> list[str]:
    with conn.cursor() as cur:
        cur.execute("SELECT tablename::text FROM pg_tables WHERE schemaname = %s ORDER BY 1", (schema,))
        return [t for (t,) in cur.fetchall()]


def stored_offsets(conn: Any, config: dict[str, Any]) -> dict[str, int]:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT topic, next_offset FROM {}.kafka_offsets WHERE pipeline = %s").format(
            sql.Identifier(config["meta_schema"])), (config["pipeline"],))
        return dict(cur.fetchall())


@pytest.mark.timeout(900)
def test_a_pattern_mirrors_every_table_a_table_created_after_the_start_included(
        connect: dict[str, str], source: Source, unique_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env, schema = connect, source.schema
    slot, connector = f"dbz_{unique_name}", f"pattern-{unique_name}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONNECT_CONN.upper()}", kafka_connect_connection(env))
    write_source(source, SOURCE_DDL)
    rng = random.Random(35)
    changes(source, rng, list(FIRST_TABLES), 0)  # rows for the initial snapshot
    definition = {"topic_prefix": schema, "tables": [{"source_pattern": f"{schema}.*"}]}
    first_topics = [f"{schema}.{schema}.{t}" for t in FIRST_TABLES]
    config = pipeline_config(env, tmp_path, f"pattern_{unique_name}", topics=first_topics[:1],
                             spec="mirror:" + json.dumps(definition), trigger="processingTime",
                             trigger_interval="2 seconds", max_offsets_per_trigger=200)
    hook = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)
    runs: list[AppRun] = []
    target = pg_connect(env)
    target.autocommit = True
    bootstrap = env["EOS_KAFKA_BOOTSTRAP"]
    try:
        hook.put_connector_config(connector, pattern_connector(env, schema, slot))
        wait_until(f"{connector} RUNNING", lambda: not hook.connector_problems(connector))

        def written(topics: list[str]) -> bool:
            try:
                ends = last_stable_offsets(bootstrap, schema)
            except KafkaException:
                return False
            return all(ends.get(t) for t in topics)

        wait_until("the first change topics", lambda: written(first_topics))
        # SIGKILLed after its first batch's apply, before its commit: the targets that batch
        # created in its transaction roll back with its rows and offsets.
        runs.append(start_app(config, tmp_path, env_extra={"EOS_FAULT_POINT": "before_commit",
                                                           "EOS_FAULT_AT_BATCH": "1"}, label="killed"))
        assert runs[0].wait(300) == -9, runs[0].log()[-3000:]
        print(f"killed run logged creating {[e['table'] for e in runs[0].events('mirror_target_created')]}")
        assert target_tables(target, config["target_schema"]) == [] and stored_offsets(target, config) == {}
        runs.append(start_app(config, tmp_path, label="pattern"))
        wait_until("the snapshot applied", lambda: runs[1].events("batch") or runs[1].process.poll() is not None,
                   timeout=300)
        assert runs[1].process.poll() is None, runs[1].log()[-4000:]
        for round_ in range(1, 4):
            changes(source, rng, list(FIRST_TABLES), round_)
        late_topic = f"{schema}.{schema}.{LATE_TABLE}"
        assert late_topic not in last_stable_offsets(bootstrap, schema)  # created after the driver subscribed
        write_source(source, [LATE_DDL])
        for round_ in range(4, 8):
            changes(source, rng, [*FIRST_TABLES, LATE_TABLE], round_)
            time.sleep(0.5)
        wait_until("the late table's topic", lambda: written([late_topic]))

        def caught_up() -> bool:
            assert runs[-1].process.poll() is None, runs[-1].log()[-4000:]
            ends = last_stable_offsets(bootstrap, schema)
            return late_topic in ends and stored_offsets(target, config) == ends

        wait_until("stored offsets at every change topic's last stable offset", caught_up, timeout=300, interval=2)
        runs[-1].kill()
        oracle = {}
        for table in [*FIRST_TABLES, LATE_TABLE]:
            wanted, found = table_rows(source.conn, schema, table), table_rows(target, config["target_schema"], table)
            oracle[table] = (sum(wanted.values()), sum((wanted - found).values()) + sum((found - wanted).values()))
        print(f"oracle (source rows, rows that differ): {oracle}")
        assert all(count > 0 and differ == 0 for count, differ in oracle.values()), oracle
        assert primary_key(target, config["target_schema"], "stock") == ["warehouse", "sku"]
        with target.cursor() as cur:
            cur.execute("SELECT column_name::text, data_type::text FROM information_schema.columns"
                        " WHERE table_schema = %s AND table_name = %s ORDER BY ordinal_position",
                        (config["target_schema"], LATE_TABLE))
            assert cur.fetchall() == [("id", "bigint"), ("note", "text"), ("amount", "numeric"), ("tags", "ARRAY"),
                                      ("doc", "jsonb"), ("born", "date"), ("blob", "bytea"),
                                      ("wakes", "time without time zone")]
        created = {e["table"] for e in runs[1].events("mirror_target_created")}
        assert created == {*FIRST_TABLES, LATE_TABLE}, created
        with target.cursor() as cur:
            cur.execute(sql.SQL("SELECT count(*) FROM {}.dead_letters").format(sql.Identifier(config["meta_schema"])))
            assert cur.fetchone() == (0,)
    finally:
        for run in runs:
            run.kill()
        target.close()
        hook.delete_connector(connector)
        drop_slot(source, slot)
