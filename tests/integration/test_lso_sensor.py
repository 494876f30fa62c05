"""A crashed transactional producer leaves the LSO stuck: the trigger and the sensor see it
(classified 'open'), and gate mode passes once the coordinator aborts the transaction."""

from __future__ import annotations

import asyncio
import time

import pytest
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
from airflow_provider_eos.sensors.lso_lag import LastStableOffsetLagSensor
from airflow_provider_eos.triggers.lso_lag import LsoLagTrigger
from tests.helpers.kafka import create_topic, delete_topics, kafka_conn_uri_env, open_transaction

pytestmark = pytest.mark.integration

CONN_ID = "eos_lso_test"
TXN_TIMEOUT_MS = 10_000
STUCK_AFTER = 3.0
POKE_INTERVAL = 0.5


@pytest.fixture
def topic(kafka_bootstrap, unique_name, monkeypatch):
    name = f"eos_lso_{unique_name}"
    create_topic(kafka_bootstrap, name, partitions=2)
    monkeypatch.setenv(*kafka_conn_uri_env(CONN_ID, kafka_bootstrap))
    yield name
    delete_topics(kafka_bootstrap, name)


async def _first_event(trigger: LsoLagTrigger, timeout: float):
    return await asyncio.wait_for(trigger.run().__anext__(), timeout)


def test_stuck_lso_detected_then_cleared_by_coordinator(kafka_bootstrap, topic):
    hook = KafkaOffsetsHook(kafka_config_id=CONN_ID)
    with open_transaction(kafka_bootstrap, topic, partition=0, count=5, txn_timeout_ms=TXN_TIMEOUT_MS) as info:
        began_at = info["began_at"]
        offsets = hook.partition_offsets([topic])
        assert (offsets[(topic, 0)].high_watermark, offsets[(topic, 0)].last_stable) == (5, 0)
        assert offsets[(topic, 1)].lag == 0

        health = LsoLagTrigger(
            topics=[topic],
            kafka_config_id=CONN_ID,
            mode="health",
            stuck_after=STUCK_AFTER,
            poke_interval=POKE_INTERVAL,
        )
        # The non-deferrable poke path, run concurrently (a worker thread) with the trigger.
        sensor = LastStableOffsetLagSensor(
            task_id="lso_health_poke",
            topics=[topic],
            kafka_config_id=CONN_ID,
            watch_mode="health",
            stuck_after=STUCK_AFTER,
            poke_interval=POKE_INTERVAL,
            timeout=30,
            deferrable=False,
        )

        async def both():
            sensor_run = asyncio.create_task(asyncio.to_thread(_expect_sensor_failure, sensor))
            event = await _first_event(health, timeout=STUCK_AFTER + 10)
            return event, time.time(), await sensor_run

        watch_started = time.time()
        event, detected_at, (sensor_message, sensor_latency) = asyncio.run(both())

    payload = event.payload
    assert payload["status"] == "stuck", payload["message"]
    rows = {p["partition"]: p for p in payload["report"]["partitions"]}
    assert rows[0]["classification"] == "open"
    assert rows[0]["lag"] == 5 and rows[0]["last_stable"] == 0
    assert rows[1]["classification"] == "ok"
    latency = detected_at - watch_started
    print(
        f"\nstuck-LSO detection (trigger): {latency:.2f}s after watching started "
        f"(stuck_after={STUCK_AFTER}s, poke_interval={POKE_INTERVAL}s), "
        f"{detected_at - began_at:.2f}s after the transaction's records were flushed"
    )
    print(f"stuck-LSO detection (non-deferrable sensor poke path): {sensor_latency:.2f}s")
    print(payload["message"])
    assert STUCK_AFTER <= latency <= STUCK_AFTER + POKE_INTERVAL + 1.0
    assert "open" in sensor_message and f"{topic}" in sensor_message
    assert STUCK_AFTER <= sensor_latency <= STUCK_AFTER + POKE_INTERVAL + 1.0

    # The coordinator aborts after transaction.timeout.ms (+ the 1 s cleanup interval).
    gate = LsoLagTrigger(topics=[topic], kafka_config_id=CONN_ID, mode="gate", poke_interval=POKE_INTERVAL)
    event = asyncio.run(_first_event(gate, timeout=TXN_TIMEOUT_MS / 1000 + 20))
    cleared_at = time.time()
    assert event.payload["status"] == "ok", event.payload["message"]
    print(f"gate passed {cleared_at - began_at:.2f}s after the flush (transaction.timeout.ms={TXN_TIMEOUT_MS})")
    assert cleared_at - began_at >= TXN_TIMEOUT_MS / 1000 - 1
    after = hook.partition_offsets([topic])[(topic, 0)]
    # 5 aborted records + the abort marker: HW == LSO == 6, nothing readable.
    assert after.high_watermark == after.last_stable == 6

    # The poke path in gate mode passes at the first poke and returns the report.
    gate_sensor = LastStableOffsetLagSensor(
        task_id="lso_gate_poke",
        topics=[topic],
        kafka_config_id=CONN_ID,
        watch_mode="gate",
        poke_interval=POKE_INTERVAL,
        timeout=10,
        deferrable=False,
    )
    report = gate_sensor.execute({})
    assert {p["classification"] for p in report["partitions"]} == {"ok"}


def _expect_sensor_failure(sensor: LastStableOffsetLagSensor) -> tuple[str, float]:
    started = time.time()
    with pytest.raises(AirflowException) as failure:
        sensor.execute({})
    return str(failure.value), time.time() - started
