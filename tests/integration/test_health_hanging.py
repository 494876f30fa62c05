"""The scheduled health check sees a hanging transaction (issue 11 item 9), on the real stack.

A transaction stays open (its producer SIGKILLed, ``transaction.timeout.ms`` 600 s so the
coordinator does not abort it during the test) for longer than a short ``hanging_after``
(20 s), while each health-check run -- a separate sensor execution, like a scheduled run --
watches for a few seconds only (``stuck_after`` 3 s, ``timeout`` 8 s). The stuck-since time
is kept in ``<meta>.lso_watch`` between runs, so:

1. the first run reports the partition ``open`` (stuck ~3 s), not hanging;
2. a run after the real stuck time passed ``hanging_after`` reports it ``hanging``, naming
   the producer (checked against the coordinator's own ``DescribeTransactions``),
   the transaction's start offset and the abort operator's parameters;
3. ``HangingTransactionsOperator(**those parameters)`` aborts it; the next run is healthy
   and the stored state is cleared.

The producer's details and the abort go through kafka-python's admin client (no JVM): from the
moment the producer is killed no child process may start, and admin clients are counted.

Both sensor paths: deferrable (the trigger serialized, re-created and run in-process with
asyncio, as the triggerer would) and non-deferrable (``poke``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, TaskDeferred
from confluent_kafka import Producer

from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
from airflow_provider_eos.hooks.kafka_transactions import KafkaTransactionsHook
from airflow_provider_eos.operators.hanging_transactions import HangingTransactionsOperator
from airflow_provider_eos.sensors.lso_lag import HANGING_XCOM_KEY, LastStableOffsetLagSensor
from airflow_provider_eos.triggers.lso_lag import LsoLagTrigger
from tests.helpers.kafka import create_topic, delete_topics, open_transaction, python_admin_only, wait_for_markers

pytestmark = pytest.mark.integration

KAFKA_CONN = "eos_hanging_kafka"
PG_CONN = "eos_hanging_pg"
STUCK_AFTER = 3.0
HANGING_AFTER = 20.0
RUN_TIMEOUT = 8.0
POKE_INTERVAL = 0.5
COMMITTED = 3  # records committed before the open transaction: it starts at offset 4 (3 + marker)


class _Ti:
    """Collects what a task instance would push to XCom."""

    def __init__(self) -> None:
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


@pytest.fixture
def setup(stack, kafka_bootstrap, unique_name, monkeypatch, pg_conn):
    topic = f"eos_hang_{unique_name}"
    meta = f"eos_hang_meta_{unique_name}"
    create_topic(kafka_bootstrap, topic, partitions=2)
    monkeypatch.setenv(f"AIRFLOW_CONN_{KAFKA_CONN.upper()}",
                       json.dumps({"conn_type": "kafka", "extra": {"bootstrap.servers": kafka_bootstrap}}))
    monkeypatch.setenv(f"AIRFLOW_CONN_{PG_CONN.upper()}", json.dumps({
        "conn_type": "postgres", "host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
        "login": stack["EOS_PG_USER"], "password": stack["EOS_PG_PASSWORD"], "schema": stack["EOS_PG_DB"]}))
    yield {"topic": topic, "meta": meta, "pipeline": f"hang_{unique_name}"}
    delete_topics(kafka_bootstrap, topic)
    with pg_conn.cursor() as cur:
        from psycopg2 import sql

        cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(meta)))


def _commit_records(bootstrap: str, topic: str, count: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"eos-hang-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(count):
        producer.produce(topic, value=f"committed-{i}".encode(), partition=0)
    producer.commit_transaction(30)
    wait_for_markers(bootstrap, topic)


def _sensor(setup: dict, run: int, deferrable: bool) -> LastStableOffsetLagSensor:
    return LastStableOffsetLagSensor(
        task_id=f"lso_lag_run{run}", topics=[setup["topic"]], kafka_config_id=KAFKA_CONN, watch_mode="health",
        stuck_after=STUCK_AFTER, poke_interval=POKE_INTERVAL, timeout=RUN_TIMEOUT, deferrable=deferrable,
        defer_after=0,  # one observation in the worker: the watch itself runs in the trigger
        pipeline=setup["pipeline"], meta_schema=setup["meta"], postgres_conn_id=PG_CONN,
        hanging_after=HANGING_AFTER,
    )


def _run(sensor: LastStableOffsetLagSensor) -> dict[str, Any]:
    """One health-check run of the sensor: ``{"ok", "message", "xcom", "seconds"}``."""
    ti = _Ti()
    context: dict[str, Any] = {"ti": ti}
    started = time.monotonic()
    try:
        if sensor.deferrable:
            try:
                sensor.execute(context)
                raise AssertionError("the deferrable sensor did not defer")
            except TaskDeferred as deferred:
                # What the triggerer does: re-create the trigger from its serialized kwargs.
                classpath, kwargs = deferred.trigger.serialize()
                assert classpath.endswith("LsoLagTrigger")
                trigger = LsoLagTrigger(**json.loads(json.dumps(kwargs)))
                event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), RUN_TIMEOUT + 10))
                sensor.resume_execution("execute_complete", {"event": event.payload}, context)
        else:
            sensor.execute(context)
        ok, message = True, "ok"
    except AirflowException as err:
        ok, message = False, str(err)
    return {"ok": ok, "message": message, "xcom": ti.xcom, "seconds": time.monotonic() - started}


def _stored(pg_conn, setup: dict) -> list[dict[str, Any]]:
    from psycopg2 import sql
    from psycopg2.extras import RealDictCursor

    with pg_conn.cursor(cursor_factory=RealDictCursor) as cur:
        cur.execute(sql.SQL("SELECT topic, partition, lso, extract(epoch FROM now() - stuck_since)::float8 AS age "
                            "FROM {}.lso_watch WHERE pipeline = %s ORDER BY partition").format(
                                sql.Identifier(setup["meta"])), (setup["pipeline"],))
        return [dict(r) for r in cur.fetchall()]


def _row(message: str, topic: str, partition: int) -> list[str]:
    """The report table's row of ``topic[partition]``: topic, partition, HW, LSO, lag, stuck_s, class."""
    for line in message.splitlines():
        cells = line.split()
        if len(cells) == 7 and cells[0] == topic and cells[1] == str(partition):
            return cells
    raise AssertionError(f"no row for {topic}[{partition}] in:\n{message}")


@pytest.mark.parametrize("deferrable", [True, False], ids=["deferrable", "poke"])
def test_hanging_transaction_seen_across_runs_then_aborted(setup, kafka_bootstrap, pg_conn, deferrable):
    topic = setup["topic"]
    _commit_records(kafka_bootstrap, topic, COMMITTED)
    start_offset = COMMITTED + 1
    with open_transaction(kafka_bootstrap, topic, partition=0, count=5, txn_timeout_ms=600_000) as info:
        pass  # the producer is SIGKILLed: its transaction stays open on the broker
    with python_admin_only() as seen:
        offsets = KafkaOffsetsHook(kafka_config_id=KAFKA_CONN).partition_offsets([topic])[(topic, 0)]
        assert (offsets.high_watermark, offsets.last_stable) == (start_offset + 5, start_offset)

        # Run 1: stuck for stuck_after within this run: open, not hanging.
        first = _run(_sensor(setup, 1, deferrable))
        assert not first["ok"]
        row = _row(first["message"], topic, 0)
        print(f"\nrun 1 ({first['seconds']:.1f}s): {' '.join(row)}")
        assert row[6] == "open" and float(row[5]) < HANGING_AFTER
        assert "hanging transaction" not in first["message"] and HANGING_XCOM_KEY not in first["xcom"]
        assert _row(first["message"], topic, 1)[6] == "ok"
        stored = _stored(pg_conn, setup)
        assert [(r["topic"], r["partition"], r["lso"]) for r in stored] == [(topic, 0, start_offset)]
        stuck_since = time.time() - stored[0]["age"]

        # Run 2, half-way: starts from the stored time, so it is open at its first observation.
        # Half-way from that stored time (not from the transaction's start, which run 1 saw a
        # moment later): the stuck time run 2 reports is then at least HANGING_AFTER / 2.
        time.sleep(max(0.0, stuck_since + HANGING_AFTER / 2 - time.time()))
        second = _run(_sensor(setup, 2, deferrable))
        row = _row(second["message"], topic, 0)
        print(f"run 2 ({second['seconds']:.1f}s): {' '.join(row)}")
        assert not second["ok"] and row[6] == "open" and float(row[5]) >= HANGING_AFTER / 2 - 1
        assert second["seconds"] < STUCK_AFTER  # no need to watch for stuck_after again

        # Run 3, once the partition has really been stuck for hanging_after: hanging, with the abort.
        time.sleep(max(0.0, stuck_since + HANGING_AFTER + 1 - time.time()))
        third = _run(_sensor(setup, 3, deferrable))
        row = _row(third["message"], topic, 0)
        print(f"run 3 ({third['seconds']:.1f}s): {' '.join(row)}\n{third['message']}")
        assert not third["ok"] and row[6] == "hanging" and HANGING_AFTER <= float(row[5]) <= HANGING_AFTER + 5
        [hanging] = third["xcom"][HANGING_XCOM_KEY]
        coordinator = KafkaTransactionsHook(kafka_config_id=KAFKA_CONN).describe_transaction(info["transactional_id"])
        assert coordinator is not None and coordinator["TransactionState"] == "Ongoing"
        assert coordinator["TopicPartitions"] == [(topic, 0)]
        assert hanging["producer"]["producer_id"] == coordinator["ProducerId"]
        assert hanging["producer"]["producer_epoch"] == coordinator["ProducerEpoch"]
        assert hanging["start_offset"] == start_offset
        abort = {"action": "abort", "kafka_config_id": KAFKA_CONN, "topic": topic, "partition": 0,
                 "start_offset": start_offset, "confirm_abort": True}
        assert hanging["abort"] == abort
        assert f"producer id {coordinator['ProducerId']}" in third["message"] and json.dumps(abort) in third["message"]
        not_aborted = KafkaOffsetsHook(kafka_config_id=KAFKA_CONN).partition_offsets([topic])[(topic, 0)]
        assert not_aborted.lag == 5

        # A person triggers exactly the reported abort.
        done = HangingTransactionsOperator(task_id="abort_hanging", **hanging["abort"]).execute({})
        assert done["aborted"] == [{"topic": topic, "partition": 0, "start_offset": start_offset}]
        wait_for_markers(kafka_bootstrap, topic)

        # Run 4: healthy, and nothing is kept for the next run.
        fourth = _run(_sensor(setup, 4, deferrable))
        print(f"run 4 ({fourth['seconds']:.1f}s): ok={fourth['ok']}")
        assert fourth["ok"], fourth["message"]
        assert _stored(pg_conn, setup) == []
    assert seen["spawn_attempts"] == []
    # Run 3's describe_producers, the coordinator check, and the operator's describe and abort (one client each).
    assert seen["admin_clients"] == 5
