"""Change records of about 1 MB: a mirror's memory is bounded by bytes, not only by records.

A topic holds ``RECORDS`` Debezium change records (JSON without schemas) of about 950 kB each, a
``text`` column of that size, over ``KEYS`` keys: creates, many updates per key, deletes with
their tombstones and keys created again, about 290 MB in all.

* **Continuous engine.** With ``continuous_max_bytes`` at 8 MiB, every cycle ends on the byte
  bound (passing it by one record at most) and the engine's peak resident memory stays far below
  that of the same backlog read with a bound that lets a cycle hold all of it, the negative
  control: without a byte bound memory grows with the backlog, and this measurement sees it.
* **Spark.** The whole backlog is one micro-batch (``max_offsets_per_trigger`` above its record
  count): the range reader's byte bound (``kafka/ranges.py``: ``READ_AHEAD_BYTES`` queued ahead,
  ``FETCH_BYTES`` per fetch, a chunk being what the queue held) keeps the reading process (the
  driver, which writes a batch this small in records itself) well below the batch's size. No
  build of this project reads ranges without a byte bound (librdkafka's queue always had one), so
  this half has no negative control; the continuous engine's shows that the measurement can fail.

Both end with the mirror equal to the stream's final state: each key's last change, deletes
applied, no key missing or extra.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest
from psycopg2 import sql

from bench.harness import PeakMemory
from tests.helpers.continuous import stop_when_caught_up
from tests.helpers.kafka import create_topic, delete_topics
from tests.streaming import pg_connect, pipeline_config, start_app, start_continuous
from tests.unit.cdc_samples import source

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS, RECORDS = 20, 300
# The broker's and the producer's record limit is about 1 MiB: a value of 950,000 characters
# plus its envelope stays under it.
VALUE_CHARS = 950_000
CYCLE_BYTES = 8 * 1024 * 1024
MIB = 1024 * 1024


def _doc(key: int, serial: int) -> str:
    """The ``doc`` of change ``serial`` of ``key``: it names the change, then fills to VALUE_CHARS."""
    return f"{key}:{serial}:".ljust(VALUE_CHARS, "x")


def _change(key: int, serial: int, op: str) -> tuple[bytes, bytes | None]:
    """One change of ``key``."""
    doc = _doc(key, serial)
    before, after = ({"id": key, "doc": None}, None) if op == "d" else (None, {"id": key, "doc": doc})
    value = {"before": before, "after": after, "op": op, "ts_ms": 1764230000123, "transaction": None,
             "source": source("blobs", lsn=1000 + serial, tx_id=500 + serial)}
    return json.dumps({"id": key}).encode(), json.dumps(value).encode()


def _workload() -> tuple[list[tuple[bytes, bytes | None]], dict[int, str]]:
    """The records in Kafka order and the final state: each live key's md5 of its last ``doc``."""
    records: list[tuple[bytes, bytes | None]] = []
    final: dict[int, str] = {}
    for serial in range(RECORDS):
        key = serial % KEYS
        op = "c" if key not in final else ("d" if serial % 7 == 0 else "u")
        records.append(_change(key, serial, op))
        if op == "d":
            records.append((json.dumps({"id": key}).encode(), None))  # the tombstone
            del final[key]
        else:
            final[key] = hashlib.md5(_doc(key, serial).encode()).hexdigest()
    return records, final


@pytest.fixture(scope="module")
def large_topic(stack: dict) -> tuple[str, str, dict[int, str]]:
    """The backlog, produced once: (topic prefix, topic, the final state)."""
    from confluent_kafka import Producer

    prefix = f"big{uuid.uuid4().hex[:8]}"
    topic = f"{prefix}.public.blobs"
    create_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=2)
    records, final = _workload()
    producer = Producer({"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"], "linger.ms": 5})
    for key, value in records:
        producer.produce(topic, key=key, value=value, partition=json.loads(key)["id"] % 2)
        producer.poll(0)
    assert producer.flush(60) == 0
    yield prefix, topic, final
    delete_topics(stack["EOS_KAFKA_BOOTSTRAP"], topic)


def _config(stack: dict, tmp_path: Path, name: str, prefix: str, topic: str, **settings) -> dict:
    mirror = {"topic_prefix": prefix, "tables": [
        {"source": "public.blobs", "key": ["id"], "columns": {"id": "bigint", "doc": "text"}}]}
    return pipeline_config(stack, tmp_path, name, topics=[topic], spec=None, mirror=mirror, **settings)


def _mirrored(stack: dict, config: dict) -> dict[int, str]:
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT id, md5(doc) FROM {}").format(sql.Identifier(config["target_schema"], "blobs")))
            return dict(cur.fetchall())
    finally:
        conn.close()


def _continuous_peak(stack: dict, tmp_path: Path, large_topic: tuple, name: str, cycle_bytes: int) -> tuple:
    prefix, topic, final = large_topic
    config = _config(stack, tmp_path, name, prefix, topic, continuous_max_bytes=cycle_bytes,
                     max_offsets_per_trigger=10 * RECORDS)
    run = start_continuous(config, tmp_path, label=name)
    memory = PeakMemory(run, 0.05)
    memory.start()
    try:
        stop_when_caught_up(stack, config, run, [topic])
    finally:
        peaks = memory.stop()
        run.kill()
    assert _mirrored(stack, config) == final
    return peaks["python_driver"], [b["bytes"] for b in run.events("batch")]


def test_the_continuous_engine_bounds_a_cycle_by_bytes(stack: dict, tmp_path: Path, unique_name: str,
                                                       large_topic: tuple) -> None:
    bounded, sizes = _continuous_peak(stack, tmp_path, large_topic, f"lb{unique_name}", CYCLE_BYTES)
    unbounded, whole = _continuous_peak(stack, tmp_path, large_topic, f"lu{unique_name}", 1024 * MIB)
    print(f"\nlarge records, continuous: peak RSS {bounded:.0f} MiB with cycles of at most {CYCLE_BYTES // MIB} MiB "
          f"({len(sizes)} cycles, largest {max(sizes) / MIB:.1f} MiB); {unbounded:.0f} MiB with cycles of up to "
          f"1 GiB ({len(whole)} cycles, largest {max(whole) / MIB:.1f} MiB)")
    assert len(sizes) >= 20 and max(sizes) <= CYCLE_BYTES + MIB  # a record past the bound at most
    assert max(whole) > 100 * MIB  # the control's cycles did hold much of the backlog
    assert bounded < unbounded - 150  # MiB: the bound is what keeps the memory down


def test_spark_reads_a_batch_of_large_records_within_the_readers_byte_bound(stack: dict, tmp_path: Path,
                                                                            unique_name: str,
                                                                            large_topic: tuple) -> None:
    prefix, topic, final = large_topic
    config = _config(stack, tmp_path, f"ls{unique_name}", prefix, topic, max_offsets_per_trigger=10 * RECORDS)
    run = start_app(config, tmp_path, label="large")
    memory = PeakMemory(run, 0.05)
    memory.start()
    try:
        assert run.wait(600) == 0, run.log()[-3000:]
    finally:
        peaks = memory.stop()
    batches = [b for b in run.events("batch") if b["applied"]]
    backlog_mib = RECORDS * VALUE_CHARS / MIB
    print(f"\nlarge records, Spark: {len(batches)} batch(es), {backlog_mib:.0f} MiB of values; peak RSS {peaks}")
    assert len(batches) == 1  # the whole backlog in one micro-batch: records bound nothing here
    assert _mirrored(stack, config) == final
    # The batch's reader (the driver for a batch this small in records, else the tasks' Python
    # workers) holds what librdkafka queued and one fetch, the chunk it stages and its own code:
    # well under the batch.
    reader = max(peaks.get("python_driver", 0.0), peaks.get("python_workers", 0.0))
    assert reader < backlog_mib * 0.75, (peaks, backlog_mib)
