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
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition
from psycopg2 import sql

from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook
from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.records.spec import load_spec
from spark_apps.eos_stream.sink.staging import create_stage, stage_ranges
from tests.helpers.cdc_source import Source, connector_config, drop_slot, source_connection, wait_until, write_source
from tests.streaming import AppRun, pg_connect, pipeline_config, start_app

CONNECT_CONN = "eos_cdc_mirror_connect"
WORKLOAD_SECONDS = 40
TABLES = {  # source table -> (key, columns in order)
    "customers": (("id",), ("id", "name", "balance", "updated_at", "prefs", "tags", "notes")),
    "order_lines": (("order_id", "line_no"), ("order_id", "line_no", "sku", "qty", "price")),
    "events": (("id",), ("id", "kind", "at", "payload")),
}
SOURCE_DDL = [
    "CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, balance numeric(20,6) NOT NULL,"
    " updated_at timestamptz NOT NULL, prefs jsonb, tags text[], notes text)",
    # Out of line and uncompressed from 2 kB on: an update that leaves notes alone sends the placeholder.
    "ALTER TABLE customers ALTER COLUMN notes SET STORAGE EXTERNAL",
    "CREATE TABLE order_lines (order_id bigint, line_no integer, sku text NOT NULL, qty integer NOT NULL,"
    " price numeric(12,2) NOT NULL, PRIMARY KEY (order_id, line_no))",
    "CREATE TABLE events (id bigint PRIMARY KEY, kind text NOT NULL, at timestamptz NOT NULL, payload jsonb)",
]


def mirror_connector(env: dict[str, str], schema: str, slot: str) -> dict[str, Any]:
    """The project's connector over the mirror's tables, naming each column's source type (a
    column added mid-stream is then typed by its events)."""
    return connector_config(env, schema, slot, list(TABLES), **{"column.propagate.source.type": ".*"})


def mirror_definition(schema: str) -> dict[str, Any]:
    return {"mirror": {
        "topic_prefix": schema,
        "tables": [
            {"source": f"{schema}.customers", "key": ["id"],
             "columns": {"id": "bigint", "name": "text", "balance": "numeric(20,6)", "updated_at": "timestamptz",
                         "prefs": "jsonb", "tags": "text[]", "notes": "text"}},
            {"source": f"{schema}.order_lines", "target": "lines", "key": ["order_id", "line_no"],
             "columns": {"order_id": "bigint", "line_no": "integer", "sku": "text", "qty": "integer",
                         "price": "numeric(12,2)"}},
            {"source": f"{schema}.events", "key": ["id"],
             "columns": {"id": "bigint", "kind": "text", "at": "timestamptz", "payload": "jsonb"}},
        ],
        "aggregates": [{"source": f"{schema}.order_lines", "target": "sku_totals", "group_by": ["sku"],
                        "sums": {"qty_total": "qty", "amount": "price"}}],
    }}



class Workload:
    """The application: multi-row transactions of inserts, updates (some to a primary key, most
    leaving the TOASTed notes alone) and deletes on the three tables, from a fixed seed."""

    def __init__(self, env: dict[str, str], schema: str) -> None:
        self.source = Source(source_connection(env), schema)
        self.random = random.Random(35)
        self.customers: set[int] = set()
        self.lines: set[tuple[int, int]] = set()
        self.events: set[int] = set()
        self.next_id = 1
        self.transactions = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _pick(self, keys: set, most: int) -> list:
        return self.random.sample(sorted(keys), min(most, len(keys)))

    def _customer_changes(self, cur: Any) -> list[bytes]:
        r, out = self.random, []
        for _ in range(r.randint(1, 3)):
            cid = self._id()
            self.customers.add(cid)
            out.append(cur.mogrify(
                "INSERT INTO customers VALUES (%s, %s, %s, now() - %s * interval '1 second', %s, %s,"
                " (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 80)))",
                (cid, f"c{cid}", f"{r.randint(-10**9, 10**9)}.{r.randint(0, 999999):06d}", r.randint(0, 10**6),
                 json.dumps({"tier": r.randint(1, 3), "tags": ["x", str(cid)]}), ["a", f"t{cid % 7}", "b c"])))
        for cid in self._pick(self.customers, 3):  # notes unchanged: Debezium sends the placeholder
            out.append(cur.mogrify("UPDATE customers SET balance = balance + %s, updated_at = now(),"
                                   " prefs = jsonb_set(coalesce(prefs, '{}'), '{n}', to_jsonb(%s)) WHERE id = %s",
                                   (f"{r.randint(1, 10**6)}.000123", r.randint(0, 99), cid)))
        if r.random() < 0.3 and self.customers:
            cid = self._pick(self.customers, 1)[0]
            out.append(cur.mogrify("UPDATE customers SET notes = repeat(md5(%s), 90), tags = NULL WHERE id = %s",
                                   (str(r.random()), cid)))
        if r.random() < 0.3 and len(self.customers) > 5:
            cid = self._pick(self.customers, 1)[0]
            self.customers.discard(cid)
            out.append(cur.mogrify("DELETE FROM customers WHERE id = %s", (cid,)))
        return out

    def _line_changes(self, cur: Any) -> list[bytes]:
        r, out = self.random, []
        order = r.randint(1, 40)
        for _ in range(r.randint(1, 4)):
            key = (order, r.randint(1, 30))
            if key not in self.lines:
                self.lines.add(key)
                price = f"{r.randint(1, 99999)}.{r.randint(0, 99):02d}"
                out.append(cur.mogrify("INSERT INTO order_lines VALUES (%s, %s, %s, %s, %s)",
                                       (*key, r.choice("abcde"), r.randint(1, 50), price)))
        for key in self._pick(self.lines, 3):  # some move to another group
            out.append(cur.mogrify("UPDATE order_lines SET qty = qty + %s, sku = CASE WHEN %s THEN %s ELSE sku END"
                                   " WHERE order_id = %s AND line_no = %s",
                                   (r.randint(-5, 5), r.random() < 0.3, r.choice("abcde"), *key)))
        if r.random() < 0.3 and self.lines:  # a primary-key change: Debezium's delete and create
            key = self._pick(self.lines, 1)[0]
            moved = (key[0], key[1] + 1000 * r.randint(1, 9))
            if moved not in self.lines:
                self.lines.discard(key)
                self.lines.add(moved)
                out.append(cur.mogrify("UPDATE order_lines SET line_no = %s WHERE order_id = %s AND line_no = %s",
                                       (moved[1], *key)))
        if r.random() < 0.4 and len(self.lines) > 5:
            key = self._pick(self.lines, 1)[0]
            self.lines.discard(key)
            out.append(cur.mogrify("DELETE FROM order_lines WHERE order_id = %s AND line_no = %s", key))
        return out

    def _event_changes(self, cur: Any) -> list[bytes]:
        r, out = self.random, []
        eid = self._id()
        self.events.add(eid)
        payload = json.dumps({"v": r.random(), "k": [1, None]})
        out.append(cur.mogrify("INSERT INTO events VALUES (%s, %s, now(), %s)",
                               (eid, r.choice(["open", "close", "päy"]), payload)))
        if r.random() < 0.3 and self.events:
            old = self._pick(self.events, 1)[0]
            self.events.discard(old)
            new = self._id()
            self.events.add(new)
            out.append(cur.mogrify("UPDATE events SET id = %s, kind = 'moved' WHERE id = %s", (new, old)))
        if r.random() < 0.3 and len(self.events) > 3:
            old = self._pick(self.events, 1)[0]
            self.events.discard(old)
            out.append(cur.mogrify("DELETE FROM events WHERE id = %s", (old,)))
        return out

    def transaction(self) -> None:
        with self.source.conn.cursor() as cur:
            statements = [*self._customer_changes(cur), *self._line_changes(cur), *self._event_changes(cur)]
        write_source(self.source, [s.decode() for s in statements])
        self.transactions += 1

    def run(self, seconds: float) -> None:
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not self.stop.is_set():
                self.transaction()
                time.sleep(self.random.uniform(0.02, 0.1))
        except BaseException as exc:  # reported by the test's main thread
            self.error = exc


def _normal(value: Any) -> Any:
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, list):
        return tuple(_normal(v) for v in value)
    return value


def rows(conn: Any, schema: str, table: str, columns: tuple[str, ...]) -> Counter:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT {} FROM {}.{}").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in columns), sql.Identifier(schema), sql.Identifier(table)))
        return Counter(tuple(_normal(v) for v in row) for row in cur.fetchall())


def differences(left: Counter, right: Counter) -> int:
    """Rows of either side the other lacks (EXCEPT ALL both ways)."""
    return sum((left - right).values()) + sum((right - left).values())


def compare(source_conn: Any, schema: str, target_conn: Any, target_schema: str) -> dict[str, tuple[int, int]]:
    """Per table (and the aggregate): (source rows, rows that differ)."""
    found = {}
    for table, (_, columns) in TABLES.items():
        target = "lines" if table == "order_lines" else table
        wanted = rows(source_conn, schema, table, columns)
        found[table] = (sum(wanted.values()), differences(wanted, rows(target_conn, target_schema, target, columns)))
    with source_conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT sku, count(*), sum(qty), sum(price) FROM {}.order_lines GROUP BY sku").format(
            sql.Identifier(schema)))
        groups = Counter(cur.fetchall())
    totals = rows(target_conn, target_schema, "sku_totals", ("sku", "row_count", "qty_total", "amount"))
    found["sku_totals"] = (sum(groups.values()), differences(groups, totals))
    return found


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
    workload = Workload(env, schema)
    for _ in range(5):  # rows for the connector's initial snapshot (op 'r')
        workload.transaction()
    definition = tmp_path / "mirror.yaml"
    definition.write_text(json.dumps(mirror_definition(schema), indent=2))  # JSON is YAML
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
        write_source(source, ["INSERT INTO customers VALUES (-1, 'last', 0, now(), NULL, NULL, NULL)",
                              "INSERT INTO order_lines VALUES (-1, -1, 'z', 1, 1)",
                              "INSERT INTO events VALUES (-1, 'last', now(), NULL)"])
        stopped = time.monotonic()

        def caught_up() -> bool:
            assert runs[-1].process.poll() is None, runs[-1].log()[-4000:]
            lso = high_watermarks(env["EOS_KAFKA_BOOTSTRAP"], topics)
            return stored_offsets(target, config) == lso

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
        workload.source.conn.close()
        hook.delete_connector(connector)
        drop_slot(source, slot)
