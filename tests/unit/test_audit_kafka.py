"""Kafka's side of the audit without a broker: reading by batches, judging, and merging the sides of
partitions read apart (``audit_kafka``), and how a read is dealt to worker processes (``audit_readers``)."""

from __future__ import annotations

import json
import pickle
import time
from typing import Any

import confluent_kafka
import pytest

from spark_apps.eos_stream.audit import kafka as audit_kafka
from spark_apps.eos_stream.audit.kafka import committed_records, judge_records, merge_sides
from spark_apps.eos_stream.audit.readers import shares, worker_count
from spark_apps.eos_stream.audit.rules import PartitionRange, keep_latest
from spark_apps.eos_stream.records.spec import AggregateTarget
from spark_apps.ledger.spec import LEDGER

AGGREGATES = [t for t in LEDGER.targets if isinstance(t, AggregateTarget)]


def _value(seq: int) -> bytes:
    return json.dumps({"event_id": f"e{seq}", "account_id": f"a{seq % 3}", "amount_cents": seq - 20,
                       "ts": "2026-01-01T00:00:00+00:00", "seq": seq}).encode()


def _records(partitions: int, per_partition: int) -> list[tuple[str, int, int, bytes | None]]:
    """Records of every account in every partition, some malformed, interleaved across partitions."""
    out = []
    for offset in range(per_partition):
        for partition in range(partitions):
            seq = offset * partitions + partition
            value = b"{oops" if seq % 11 == 0 else None if seq % 13 == 0 else _value(seq)
            out.append(("t", partition, offset, value))
    return out


def _comparable(side: audit_kafka.KafkaSide) -> Any:
    return (side.committed, [{tp: set(o) for tp, o in r.items() if o} for r in side.valid],
            [{tp: set(o) for tp, o in r.items() if o} for r in side.malformed],
            [[dict(by_group) for by_group in r] for r in side.sums],
            [[dict(by_group) for by_group in r] for r in side.latest], side.dead_seen)


def test_merged_sides_of_partitions_read_apart_are_the_side_of_one_read() -> None:
    records = _records(4, 30)
    ranges = {("t", p): PartitionRange(0, 30, 20 + p, True) for p in range(4)}  # a tail in each partition
    dead = {("t", 1, 3), ("t", 2, 29)}
    whole = judge_records(LEDGER, AGGREGATES, ranges, dead, records)
    parts = [judge_records(LEDGER, AGGREGATES, {tp: r for tp, r in ranges.items() if tp[1] in share},
                           {d for d in dead if d[1] in share}, [r for r in records if r[1] in share])
             for share in ({0, 3}, {1}, {2})]
    merged = merge_sides(len(AGGREGATES), [pickle.loads(pickle.dumps(part)) for part in reversed(parts)])
    assert _comparable(merged) == _comparable(whole)
    assert merged.dead_seen.keys() == dead
    # Per account and partition, the latest seq is that of its last record there; folded over the
    # partitions, that of its record at the highest (partition, offset).
    latest: dict[tuple, dict] = {}
    for (group, (_topic, partition)), values in whole.latest[1][0].items():
        assert values["last_seq"][0][0] == partition
        keep_latest(latest.setdefault(group, {}), "last_seq", *values["last_seq"])
    assert latest[("a2",)]["last_seq"][0] == (3, 29)


class _Message:
    def __init__(self, partition: int, offset: int, value: bytes | None = b"{}", eof: bool = False) -> None:
        self._partition, self._offset, self._value, self._eof = partition, offset, value, eof

    def error(self) -> Any:
        return confluent_kafka.KafkaError(confluent_kafka.KafkaError._PARTITION_EOF) if self._eof else None

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes | None:
        return self._value


class _Consumer:
    """Hands out one batch ending at the partition's end, and then reports the position past it
    (as librdkafka does once consume() returned the batch), as if over two seconds had passed."""

    def __init__(self, config: dict) -> None:
        self.batches = [[_Message(0, o) for o in range(5)], []]
        self.delivered = 0

    def assign(self, partitions: list) -> None:
        pass

    def consume(self, count: int, timeout: float) -> list[_Message]:
        batch = self.batches.pop(0) if self.batches else []
        self.delivered += len(batch)
        return batch

    def position(self, partitions: list) -> list:
        return [confluent_kafka.TopicPartition(tp.topic, tp.partition, self.delivered) for tp in partitions]

    def close(self) -> None:
        pass


def test_a_batch_is_taken_before_the_position_that_passes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(float(3 * n) for n in range(100))
    monkeypatch.setattr(audit_kafka.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(confluent_kafka, "Consumer", _Consumer)
    got = list(committed_records("b", None, starts={("t", 0): 0}, ends={("t", 0): 5}, timeout=60, deadline=1e9))
    assert [offset for _t, _p, offset, _v in got] == [0, 1, 2, 3, 4]


def test_a_read_is_dealt_largest_partition_first_to_the_least_loaded_worker() -> None:
    ranges = {("t", 0): PartitionRange(0, 100, 100, True), ("t", 1): PartitionRange(0, 60, 60, True),
              ("t", 2): PartitionRange(10, 60, 60, True), ("t", 3): PartitionRange(5, 5, 5, True),
              ("u", 0): PartitionRange(0, 40, 40, True)}
    assert [sorted(share) for share in shares(ranges, 2)] == [[("t", 0), ("u", 0)], [("t", 1), ("t", 2)]]
    assert worker_count(ranges, 8) == 4  # never more than the partitions with offsets to read
    assert worker_count(ranges, 1) == 1
    assert worker_count(ranges, None) == 1  # 250 offsets: below PARALLEL_MIN_RECORDS, read here


def test_workers_that_never_answer_are_named_in_the_timeout_and_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    from spark_apps.eos_stream.audit import readers as audit_readers
    from spark_apps.eos_stream.audit.kafka import ReadTask
    from spark_apps.eos_stream.audit.rules import AuditTimeout

    # Workers that read their task and then hang, as a worker stuck in a call that never returns.
    hang = "import sys, time; sys.stdin.buffer.read(); time.sleep(120)  # {root}"
    monkeypatch.setattr(audit_readers, "_WORKER", hang)
    monkeypatch.setattr(audit_readers, "ANSWER_GRACE", 0.5)
    ranges = {("t", p): PartitionRange(0, 10 * (p + 1), 0, True) for p in range(3)}
    task = ReadTask("b", {"sasl.password": "secret"}, LEDGER, AGGREGATES, ranges, frozenset(), 1.0,
                    time.monotonic() + 1.0)
    with audit_readers.KafkaRead(task, workers=2) as reading:
        procs = [proc for proc, _share in reading.procs]
        assert len(procs) == 2 and all(b"secret" not in " ".join(proc.args).encode() for proc in procs)
        with pytest.raises(AuditTimeout) as caught:
            reading.side()
    assert all(proc.returncode is not None for proc in procs)  # killed and reaped
    message = str(caught.value)
    assert message.startswith("audit timed out after 1s reading Kafka; 3 partition(s) did not finish: "
                              "t[0] at offset 0 of 10, t[1] at offset 0 of 20, t[2] at offset 0 of 30.")
    assert f"worker process(es) {procs[0].pid}, {procs[1].pid} did not answer within 0.5s" in message


def test_aggregates_of_a_two_field_key_are_the_plain_fold_of_the_records() -> None:
    """judge_records works out each aggregate's key, increments and latest values once, not per
    record: its totals equal a plain fold over the valid records (a key of two fields, a count,
    a NULL that adds nothing, a latest value), split at the stored offset."""
    from spark_apps.eos_stream.records.spec import Field, PipelineSpec, RowTarget

    fields = (Field("a", "text"), Field("b", "integer"), Field("n", "bigint", required=False))
    spec = PipelineSpec("pairs", fields=fields,
                        targets=(RowTarget("rows", columns=("a", "b", "n")),
                                 AggregateTarget("pairs", group_by=("a", "b"), increments={"total": "n", "count": None},
                                                 latest={"last_n": "n"})))
    aggregate = spec.targets[1]
    assert isinstance(aggregate, AggregateTarget)
    records = [("t", p, o, json.dumps({"a": f"k{o % 2}", "b": o % 3, "n": None if o % 5 == 0 else o}).encode())
               for p in range(2) for o in range(40)]
    ranges = {("t", p): PartitionRange(0, 40, 25, True) for p in range(2)}
    side = judge_records(spec, [aggregate], ranges, frozenset(), records)
    for region in (0, 1):
        totals: dict[tuple, dict[str, int]] = {}
        latest: dict[tuple, tuple] = {}  # (key, (topic, partition)) -> its last record there
        for _t, p, o, value in records:
            if (o < 25) != (region == 0):
                continue
            record = json.loads(value)
            key = (record["a"], record["b"])
            sums = totals.setdefault(key, {"total": 0, "count": 0})
            sums["count"] += 1
            sums["total"] += record["n"] or 0
            if (key, ("t", p)) not in latest or (p, o) > latest[(key, ("t", p))][0]:
                latest[(key, ("t", p))] = ((p, o), record["n"])
        assert {k: {c: v for c, v in s.items() if v} for k, s in totals.items()} == \
            {k: dict(+c) for k, c in side.sums[region][0].items()}
        assert latest == {k: v["last_n"] for k, v in side.latest[region][0].items()}
