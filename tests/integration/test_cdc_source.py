"""The change-data-capture source on the real stack: Kafka Connect (scripts/stack.sh start-connect)
runs Debezium's PostgreSQL connector, created through KafkaConnectHook with pgoutput, an initial
snapshot and exactly-once delivery required; multi-row transactions on the source arrive as
Debezium envelopes in Kafka transactions, and their ENDs (no BEGINs) in the transaction topic.
Then the health checks: a paused and a deleted connector, and a replication slot held back while
the connector is paused, each fail naming them."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook
from airflow_provider_eos.operators.cdc_health import ConnectorHealthCheckOperator, ReplicationSlotCheckOperator
from airflow_provider_eos.utils.debezium_config import postgres_connector_config
from tests.helpers.cdc_source import Source, drop_slot, pause_connector, source_connection, wait_until, write_source

CONNECT_CONN = "eos_cdc_connect_test"
SOURCE_CONN = "eos_cdc_source_test"


@pytest.fixture
def connections(connect: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    host, port = connect["EOS_CONNECT_URL"].removeprefix("http://").split(":")
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONNECT_CONN.upper()}", json.dumps(
        {"conn_type": "kafka_connect", "host": host, "port": int(port), "schema": "http"}))
    # The cluster's superuser: the slot's age reads pg_ls_waldir() (superuser or pg_monitor).
    monkeypatch.setenv(f"AIRFLOW_CONN_{SOURCE_CONN.upper()}", json.dumps({
        "conn_type": "postgres", "host": connect["EOS_PG_HOST"], "port": int(connect["EOS_PG_PORT"]),
        "login": connect["EOS_PG_USER"], "password": connect["EOS_PG_PASSWORD"],
        "schema": connect["EOS_SOURCE_PG_DB"]}))



def committed_reader(bootstrap: str, topic: str) -> Consumer:
    """A consumer of ``topic`` from its start, in a group of its own, read_committed."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"cdc-test-{time.time_ns()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "isolation.level": "read_committed"})
    consumer.subscribe([topic])
    return consumer


def read_changes(bootstrap: str, topic: str, count: int, timeout: float = 120.0) -> list[tuple[Any, Any]]:
    """``count`` records of ``topic`` from its start, read_committed: (key payload, value) pairs,
    value None for a tombstone, else the envelope's payload."""
    consumer = committed_reader(bootstrap, topic)
    records: list[tuple[Any, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(records) < count and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None or msg.error():
                continue
            key = json.loads(msg.key())["payload"]
            value = None if msg.value() is None else json.loads(msg.value())["payload"]
            records.append((key, value))
        extra = consumer.poll(3.0)  # nothing more may arrive: each change exactly once
        assert extra is None or extra.error(), f"an unexpected record after {count}: {extra.value()!r}"
    finally:
        consumer.close()
    assert len(records) == count, f"{len(records)} of {count} records within {timeout:.0f}s: {records}"
    return records


def transaction_records(bootstrap: str, topic: str, counted: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The transaction topic's records (payloads) from its start, read_committed, until ``counted``
    of them count events and nothing more arrives for 3 s. Other tests' source transactions may
    add empty ones (count 0): pgoutput publishes every table of the source database."""
    consumer = committed_reader(bootstrap, topic)
    records: list[dict[str, Any]] = []
    deadline, quiet_until = time.monotonic() + timeout, 0.0
    try:
        while time.monotonic() < min(deadline, quiet_until or deadline):
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error() and msg.value() is not None:
                records.append(json.loads(msg.value())["payload"])
                if sum(1 for r in records if r["event_count"]) >= counted:
                    quiet_until = time.monotonic() + 3.0
    finally:
        consumer.close()
    return records


def high_watermark(bootstrap: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "cdc-test-watermark"})
    try:
        return int(consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1])
    finally:
        consumer.close()


class _Ti:
    def __init__(self) -> None:
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


def run_check(operator: Any) -> tuple[bool, str, dict[str, Any]]:
    """Runs a health check operator: whether it passed, its message, and its recorded eos_check."""
    ti = _Ti()
    try:
        operator.execute({"ti": ti})
    except Exception as err:  # the failure is the outcome under test
        return False, str(err), ti.xcom["eos_check"]
    return True, ti.xcom["eos_check"]["message"], ti.xcom["eos_check"]


def test_debezium_changes_arrive_exactly_once_and_health_checks_name_what_is_wrong(
        connect: dict[str, str], connections: None, source: Source, unique_name: str) -> None:
    schema, slot, name = source.schema, f"dbz_{unique_name}", f"cdc-{unique_name}"
    topic = f"{schema}.{schema}.accounts"
    bootstrap = connect["EOS_KAFKA_BOOTSTRAP"]
    write_source(source, [
        "CREATE TABLE accounts (id int PRIMARY KEY, owner text NOT NULL, balance numeric(20,6) NOT NULL)",
        # FULL: the before image of an update or delete carries every column, not only the key.
        "ALTER TABLE accounts REPLICA IDENTITY FULL",
        "CREATE TABLE filler (id int PRIMARY KEY, pad text)",
        "INSERT INTO accounts VALUES (1, 'ann', 100.123456), (2, 'bob', 12345678901234.000001), (3, 'cy', 0)",
    ])
    hook = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)
    try:
        created = hook.put_connector_config(
            name, postgres_connector_config(connect, schema, slot, [f"{schema}.accounts"]))
        assert created["name"] == name
        assert "${file:" in hook.get_connector_config(name)["database.password"]  # no password stored
        wait_until(f"{name} RUNNING", lambda: not hook.connector_problems(name))

        snapshot = read_changes(bootstrap, topic, 3)
        assert [(k["id"], v["op"], v["after"]["balance"]) for k, v in snapshot] == [
            (1, "r", "100.123456"), (2, "r", "12345678901234.000001"), (3, "r", "0.000000")]

        write_source(source, ["INSERT INTO accounts VALUES (4, 'dee', 4.5), (5, 'eve', 5)",
                              "UPDATE accounts SET balance = balance + 1 WHERE id = 1"])
        write_source(source, ["UPDATE accounts SET owner = 'dora' WHERE id = 4",
                              "DELETE FROM accounts WHERE id IN (2, 5)"])
        changes = read_changes(bootstrap, topic, 3 + 8)[3:]
        summary = [(k["id"], v and v["op"]) for k, v in changes]
        assert summary == [(4, "c"), (5, "c"), (1, "u"), (4, "u"), (2, "d"), (2, None), (5, "d"), (5, None)]
        envelopes = [v for _, v in changes]
        assert envelopes[0]["before"] is None
        assert envelopes[0]["after"] == {"id": 4, "owner": "dee", "balance": "4.500000"}
        assert envelopes[2]["before"]["balance"] == "100.123456"
        assert envelopes[2]["after"]["balance"] == "101.123456"
        assert envelopes[3]["before"]["owner"] == "dee" and envelopes[3]["after"]["owner"] == "dora"
        assert envelopes[4]["before"] == {"id": 2, "owner": "bob", "balance": "12345678901234.000001"}
        assert envelopes[4]["after"] is None
        assert {e["source"]["table"] for e in envelopes if e} == {"accounts"}
        # Two source transactions, two envelopes' txId sets; and the topic was written in Kafka
        # transactions: each commit marker takes an offset, so the log is longer than its records.
        assert len({e["source"]["txId"] for e in envelopes if e}) == 2
        assert high_watermark(bootstrap, topic) > 3 + 8
        # The transaction topic holds each source transaction's END, counting its 3 events, and
        # no BEGIN: the connector config's filter drops them before they are written.
        transactions = transaction_records(bootstrap, f"{schema}.transaction", counted=2)
        assert [r["status"] for r in transactions if r["status"] != "END"] == []
        assert [(r["event_count"], r["data_collections"][0]["data_collection"])
                for r in transactions if r["event_count"]] == [(3, f"{schema}.accounts")] * 2

        check_health(hook, name, slot, source)
    finally:
        hook.delete_connector(name)
        drop_slot(source, slot)


# WAL is the whole PostgreSQL cluster's, and the other xdist worker's tests write into it. A
# connector confirms only WAL it was sent, and pgoutput sends nothing for another database's
# writes: with an idle source its slot holds all of theirs (a clean-clone CI saw it above 4 MiB
# for 90 s). So every wait for a confirming slot writes a change first, and a healthy slot is
# judged against a bound far above what the other worker writes between two confirmations.
HEALTHY_HELD_BYTES = 64 * 1024**2
# While paused, the connector confirms nothing: the ~20 MB of WAL written then is certainly held.
PAUSED_HELD_BYTES = 4 * 1024**2


def slot_check(slot: str, max_held_bytes: int) -> ReplicationSlotCheckOperator:
    return ReplicationSlotCheckOperator(task_id="slot", slot_name=slot, postgres_conn_id=SOURCE_CONN,
                                        max_held_bytes=max_held_bytes, max_age_seconds=3600)


def wait_for_confirmed(source: Source, check: ReplicationSlotCheckOperator, what: str, timeout: float) -> None:
    """Until ``check`` passes, each try after a change the connector publishes and confirms."""
    last: list[str] = []

    def confirmed() -> bool:
        write_source(source, ["UPDATE accounts SET balance = balance + 1 WHERE id = 3"])
        ok, message, _ = run_check(check)
        last[:] = [message]
        return ok
    try:
        wait_until(what, confirmed, timeout=timeout, interval=2)
    except AssertionError as err:
        raise AssertionError(f"{err}: {last}") from None


def check_health(hook: KafkaConnectHook, name: str, slot: str, source: Source) -> None:
    connector_check = ConnectorHealthCheckOperator(task_id="connector", connectors=[name],
                                                   kafka_connect_conn_id=CONNECT_CONN)
    ok, message, recorded = run_check(connector_check)
    assert ok and recorded["ok"], message
    wait_for_confirmed(source, slot_check(slot, HEALTHY_HELD_BYTES), f"{slot} confirming", timeout=90)

    pause_connector(hook, name)
    ok, message, recorded = run_check(connector_check)
    assert not ok and not recorded["ok"]
    assert f"connector '{name}' is PAUSED" in message, message

    # ~20 MB of WAL the paused connector cannot confirm: the slot holds it back.
    write_source(source, ["INSERT INTO filler SELECT g, repeat(md5(g::text), 12) FROM generate_series(1, 40000) g"])
    ok, message, recorded = run_check(slot_check(slot, PAUSED_HELD_BYTES))
    assert not ok and not recorded["ok"], message
    assert f"replication slot '{slot}' holds back" in message, message
    held = int(re.search(r"holds back (\d+) bytes", message).group(1))  # type: ignore[union-attr]
    assert held > PAUSED_HELD_BYTES and recorded["report"]["held_bytes"] >= held, (held, recorded)
    assert re.search(r"oldest ~\d+s old", message), message  # its age, as the superuser may read it

    hook.resume_connector(name)
    wait_until(f"{name} RUNNING again", lambda: not hook.connector_problems(name))
    # The application writes again: the connector confirms past the held WAL, and the server lets
    # it go at its next running-transactions record (every 15 s while WAL is written). Released
    # means holding less than half of what it held while paused, whatever the other worker
    # writes meanwhile.
    wait_for_confirmed(source, slot_check(slot, held // 2), f"{slot} released again", timeout=120)

    # Connect removes a connector asynchronously: for a moment it is still listed, then its
    # status still says UNASSIGNED (a failure too, naming it), then it does not exist.
    hook.delete_connector(name)
    wait_until(f"{name} gone", lambda: "does not exist" in run_check(connector_check)[1])
    ok, message, recorded = run_check(connector_check)
    assert not ok and not recorded["ok"]
    assert f"connector '{name}' does not exist" in message, message


def test_the_cdc_role_reads_the_source_tables_and_not_the_roles_password_hashes(stack: dict[str, str]) -> None:
    """Debezium's role may replicate and read the source's tables (its initial snapshot), those
    made after ``stack.sh start`` too, and nothing else: not ``pg_authid``, whose password hashes
    ``pg_read_all_data`` would let it read."""
    import psycopg2
    from psycopg2 import errors, sql

    schema, table = f"cdc_grants_{time.time_ns()}", "readable"
    place = sql.Identifier(schema, table)
    superuser = source_connection(stack)
    with open(stack["EOS_SOURCE_PG_PASSWORD_FILE"]) as secret:
        password = secret.read().strip()
    cdc = psycopg2.connect(host=stack["EOS_PG_HOST"], port=stack["EOS_PG_PORT"], user=stack["EOS_SOURCE_PG_USER"],
                           password=password, dbname=stack["EOS_SOURCE_PG_DB"])
    cdc.autocommit = True
    try:
        with superuser.cursor() as cur:
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            cur.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(place))
            cur.execute(sql.SQL("INSERT INTO {} VALUES (1)").format(place))
        with cdc.cursor() as cur:
            cur.execute(sql.SQL("SELECT id FROM {}").format(place))
            assert cur.fetchall() == [(1,)]
            with pytest.raises(errors.InsufficientPrivilege):
                cur.execute("SELECT rolname, rolpassword FROM pg_authid")
            cur.execute("SELECT pg_has_role(current_user, 'pg_read_all_data', 'MEMBER')")
            assert cur.fetchone() == (False,)
    finally:
        cdc.close()
        with superuser.cursor() as cur:
            cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        superuser.close()
