"""The recovery gate under continuous transactional traffic (issue 10, section 2).

Two transactional producers with different ``transactional.id``s write to every
partition of one topic and hand over to each other: one opens its next
transaction (records flushed) before the other commits, so at every instant
some transaction with records is open on every partition and the LSO lag is
never 0 on all partitions at once, while each LSO advances at every commit
(about every ``HALF_PERIOD`` seconds). A gate that waits for "lag 0 everywhere"
cannot pass under that load; a gate on "no partition is stuck" must. A third
producer that opens a transaction on one partition and dies (long
``transaction.timeout.ms``, so the coordinator does not abort it during the
test) makes that partition stuck: the gate must then fail, naming it.

The two producers run in a child process started from this module
(``python -m tests.integration.test_gate_under_load BOOTSTRAP TOPIC ...``) so that
they can be SIGKILLed and never share the GIL with the gate being measured.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
from airflow_provider_eos.sensors.lso_lag import LastStableOffsetLagSensor
from airflow_provider_eos.triggers.lso_lag import LsoLagTrigger
from tests.helpers.kafka import create_topic, delete_topics, kafka_conn_uri_env, open_transaction

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONN_ID = "eos_gate_load_test"
PARTITIONS = 3
STUCK_PARTITION = 2
HALF_PERIOD = 0.4  # each producer commits every ~0.8 s; the LSO moves every ~0.4 s
RECORDS_PER_TXN = 5  # per partition: ~40 records/s in all
STUCK_AFTER = 4.0
POKE_INTERVAL = 0.5
PASS_BOUND = 10.0  # the gate must pass within this under the overlapping load
GIVE_UP_AFTER = 12.0  # the gate's timeout once a partition is stuck
CHILD_MAX_SECONDS = 240  # the producer child ends on its own even if the test dies
STUCK_TXN_TIMEOUT_MS = 300_000  # far longer than the test: only the gate can notice it


@pytest.fixture
def topic(kafka_bootstrap, unique_name, monkeypatch):
    name = f"eos_gate_{unique_name}"
    create_topic(kafka_bootstrap, name, partitions=PARTITIONS)
    monkeypatch.setenv(*kafka_conn_uri_env(CONN_ID, kafka_bootstrap))
    yield name
    delete_topics(kafka_bootstrap, name)


class _Sampler(threading.Thread):
    """Reads HW and LSO every 0.2 s so the test can state what the old rule
    ("LSO lag 0 on every partition at once") would have seen."""

    def __init__(self, topic: str) -> None:
        super().__init__(daemon=True)
        self.topic = topic
        self.samples: list[tuple[float, dict[int, tuple[int, int]]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        hook = KafkaOffsetsHook(kafka_config_id=CONN_ID)
        while not self.stop.wait(0.2):
            offsets = hook.partition_offsets([self.topic], include_earliest=False)
            self.samples.append(
                (time.time(), {k[1]: (v.high_watermark, v.last_stable) for k, v in offsets.items()})
            )

    def all_caught_up_count(self) -> int:
        return sum(1 for _, parts in self.samples if all(hw == lso for hw, lso in parts.values()))

    def wait_lso_stopped(self, partition: int, moving: int, quiet: float, bound: float) -> float:
        """Seconds until ``partition``'s LSO has stayed put (with lag) for ``quiet``
        seconds while ``moving``'s LSO kept advancing (so the load is alive and it
        is the partition that is blocked, not the producers that stalled)."""
        started = time.time()
        while time.time() - started < bound:
            time.sleep(0.2)
            since = time.time() - quiet
            recent = [parts for t, parts in self.samples if t >= since]
            if self.samples[0][0] <= since and len(recent) >= 3:
                blocked = {parts[partition][1] for parts in recent}
                lagging = all(parts[partition][0] > parts[partition][1] for parts in recent)
                if len(blocked) == 1 and lagging and len({parts[moving][1] for parts in recent}) > 1:
                    return time.time() - started
        raise AssertionError(f"the LSO of partition {partition} did not stop within {bound}s")

    def lso_moves(self, partition: int) -> int:
        values = [parts[partition][1] for _, parts in self.samples if partition in parts]
        return sum(1 for a, b in itertools.pairwise(values) if b > a)


def _start_overlapping_producers(bootstrap: str, topic: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.test_gate_under_load", bootstrap, topic, str(PARTITIONS),
         str(HALF_PERIOD), str(RECORDS_PER_TXN), str(CHILD_MAX_SECONDS)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line or not json.loads(line).get("ready"):
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"overlapping producers did not start: {line!r}")
    return proc


def _gate_trigger(topic: str, deadline: float | None = None) -> LsoLagTrigger:
    kwargs = {"deadline": deadline} if deadline is not None else {}
    return LsoLagTrigger(
        topics=[topic], kafka_config_id=CONN_ID, mode="gate", stuck_after=STUCK_AFTER,
        poke_interval=POKE_INTERVAL, **kwargs,
    )


def _gate_sensor(topic: str, timeout: float) -> LastStableOffsetLagSensor:
    return LastStableOffsetLagSensor(
        task_id="gate_poke", topics=[topic], kafka_config_id=CONN_ID, watch_mode="gate",
        stuck_after=STUCK_AFTER, poke_interval=POKE_INTERVAL, timeout=timeout, deferrable=False,
    )


def _run_sensor(sensor: LastStableOffsetLagSensor) -> tuple[object, float]:
    """(the return value or the exception, seconds)."""
    started = time.time()
    try:
        outcome: object = sensor.execute({})
    except Exception as err:  # the test asserts on the type
        outcome = err
    return outcome, time.time() - started


async def _gate_and_sensor(trigger: LsoLagTrigger, sensor: LastStableOffsetLagSensor, bound: float):
    """Runs the trigger (the deferrable path) and the poke path side by side."""
    started = time.time()
    sensor_run = asyncio.create_task(asyncio.to_thread(_run_sensor, sensor))
    try:
        event = await asyncio.wait_for(trigger.run().__anext__(), bound)
    except asyncio.TimeoutError:
        event = None
    trigger_seconds = time.time() - started
    return event, trigger_seconds, await sensor_run


def test_gate_passes_under_overlapping_transactions_and_fails_on_a_stuck_partition(kafka_bootstrap, topic):
    producers = _start_overlapping_producers(kafka_bootstrap, topic)
    sampler = _Sampler(topic)
    sampler.start()
    try:
        # -- 1. overlapping open transactions, nothing stuck: the gate passes.
        phase1_started = time.time()
        event, passed_after, (sensor_outcome, sensor_seconds) = asyncio.run(
            _gate_and_sensor(_gate_trigger(topic), _gate_sensor(topic, PASS_BOUND), PASS_BOUND)
        )
        # The old rule gets the whole bound: sample until it is over.
        time.sleep(max(0.0, phase1_started + PASS_BOUND - time.time()))
        phase1_samples = len(sampler.samples)
        caught_up = sampler.all_caught_up_count()
        moves = {p: sampler.lso_moves(p) for p in range(PARTITIONS)}
        print(f"\nphase 1: {phase1_samples} samples in {PASS_BOUND:.0f}s, all-partitions-caught-up "
              f"(the old gate's rule) in {caught_up} of them, LSO moves per partition {moves}")
        assert event is not None, (
            f"the gate did not pass within {PASS_BOUND}s under overlapping transactions "
            f"(lag 0 on every partition at once in {caught_up} of {phase1_samples} samples)"
        )
        payload = event.payload
        assert payload["status"] == "ok", payload["message"]
        print(f"gate (trigger) passed after {passed_after:.2f}s; poke path: {sensor_outcome!r:.60} "
              f"after {sensor_seconds:.2f}s\n{payload['message']}")
        rows = {p["partition"]: p for p in payload["report"]["partitions"]}
        assert set(rows) == set(range(PARTITIONS))
        # It passed with transactions open: the old rule (lag 0 everywhere) did not hold.
        assert any(r["lag"] > 0 for r in rows.values())
        assert all(r["classification"] in ("ok", "lagging") for r in rows.values())
        assert passed_after < PASS_BOUND
        assert isinstance(sensor_outcome, dict), sensor_outcome
        assert sensor_seconds < PASS_BOUND
        # The load really was the one the old gate cannot pass: never lag 0 on every
        # partition at once, while every LSO kept moving.
        assert phase1_samples >= PASS_BOUND  # ~5 a second
        assert caught_up == 0
        assert all(m >= PASS_BOUND / 2 for m in moves.values()), moves

        # -- 2. a third producer dies inside a transaction on one partition.
        with open_transaction(
            kafka_bootstrap, topic, partition=STUCK_PARTITION, count=5, txn_timeout_ms=STUCK_TXN_TIMEOUT_MS
        ):
            from airflow.sdk.exceptions import AirflowException

            # Its transaction blocks the LSO once the load's older transactions there
            # have committed; the gate is asked after that (a gate asked before it
            # rightly passes: the LSO was still moving).
            blocked_after = sampler.wait_lso_stopped(STUCK_PARTITION, moving=0, quiet=6 * HALF_PERIOD, bound=15)
            print(f"phase 2: partition {STUCK_PARTITION}'s LSO stopped {blocked_after:.1f}s after the producer died")
            deadline = time.time() + GIVE_UP_AFTER
            event, failed_after, (sensor_outcome, sensor_seconds) = asyncio.run(
                _gate_and_sensor(
                    _gate_trigger(topic, deadline=deadline),
                    _gate_sensor(topic, GIVE_UP_AFTER),
                    GIVE_UP_AFTER + 10,
                )
            )
        assert producers.poll() is None, "the overlapping producers stopped early"
        assert event is not None, f"the gate neither passed nor failed within {GIVE_UP_AFTER + 10}s"
        payload = event.payload
        print(f"phase 2: gate (trigger) ended '{payload['status']}' after {failed_after:.2f}s; "
              f"poke path raised after {sensor_seconds:.2f}s\n{payload['message']}")
        assert payload["status"] == "stuck", payload["message"]
        rows = {p["partition"]: p for p in payload["report"]["partitions"]}
        assert rows[STUCK_PARTITION]["classification"] == "open"
        assert rows[STUCK_PARTITION]["stuck_seconds"] >= STUCK_AFTER
        assert f"{topic}[{STUCK_PARTITION}]" in payload["message"]
        # Only the dead producer's partition is stuck; the others keep moving.
        assert [p for p, r in rows.items() if r["classification"] in ("open", "hanging")] == [STUCK_PARTITION]
        assert GIVE_UP_AFTER - 2 * POKE_INTERVAL - 1 <= failed_after <= GIVE_UP_AFTER + 2
        assert isinstance(sensor_outcome, AirflowException), sensor_outcome
        assert f"{topic}[{STUCK_PARTITION}]" in str(sensor_outcome)
        assert sensor_seconds <= GIVE_UP_AFTER + 2
    finally:
        sampler.stop.set()
        sampler.join(10)
        if producers.poll() is None:
            producers.kill()
        producers.wait(10)


# ------------------------------------------------------------------ the producer child
def _overlapping_producers(
    bootstrap: str, topic: str, partitions: int, half_period: float, records: int, max_seconds: float
) -> int:
    from confluent_kafka import Producer

    run = uuid.uuid4().hex[:8]
    pair = [
        Producer({"bootstrap.servers": bootstrap, "transactional.id": f"eos-gate-{name}-{run}",
                  "transaction.timeout.ms": 60_000, "enable.idempotence": True, "linger.ms": 0})
        for name in ("a", "b")
    ]
    for producer in pair:
        producer.init_transactions(30)
    sequence = 0

    def open_next(producer) -> None:
        nonlocal sequence
        producer.begin_transaction()
        for partition in range(partitions):
            for _ in range(records):
                producer.produce(topic, value=f"load-{sequence}".encode(), partition=partition)
                sequence += 1
        # Flushed before the other commits: its records are on the broker, so the
        # LSO never catches up with the HW between the two transactions.
        if producer.flush(30):
            raise RuntimeError("records not flushed")

    open_next(pair[0])
    open_next(pair[1])
    print(json.dumps({"ready": True}), flush=True)
    ends_at = time.monotonic() + max_seconds
    current = 0
    while time.monotonic() < ends_at:
        time.sleep(half_period)
        pair[current].commit_transaction(30)
        open_next(pair[current])
        current = 1 - current
    return 0


if __name__ == "__main__":
    b, t, n, h, r, m = sys.argv[1:7]
    sys.exit(_overlapping_producers(b, t, int(n), float(h), int(r), float(m)))
