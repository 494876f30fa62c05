"""Lost data: which stored offsets Kafka no longer holds, what the run says and exits, the reset's
plan, and the audit's accepted gaps."""

from __future__ import annotations

import json
from typing import Any

import pytest

from spark_apps.eos_stream.audit.rules import accepted_gap_offsets, without_accepted_gaps
from spark_apps.eos_stream.kafka.lost_data import EXIT_DATA_LOST, DataLost, LostPartition, lost_partitions
from spark_apps.eos_stream.run import entry
from spark_apps.eos_stream.run.offsets_reset import ResetRefused, plan_moves


def test_a_stored_offset_outside_the_log_is_lost() -> None:
    bounds = {("t", 0): (10, 50), ("t", 1): (0, 20), ("t", 2): (5, 9), ("t", 3): (0, 0), ("t", 4): (3, 8)}
    stored = {("t", 0): 4, ("t", 1): 35, ("t", 2): 5, ("t", 3): 0, ("t", 4): 8}
    assert lost_partitions(stored, bounds) == [LostPartition("t", 0, 4, 10, 50), LostPartition("t", 1, 35, 0, 20)]
    assert lost_partitions({}, bounds) == []  # never applied: reads from the earliest


def test_the_data_lost_message_names_each_partition_and_the_way_out() -> None:
    lost = DataLost("orders", [LostPartition("t", 0, 4, 10, 50), LostPartition("t", 1, 35, 0, 20)])
    text = str(lost)
    assert "t[0]: stored offset 4, log start 10, log end 50 (records below the log start were deleted" in text
    assert "t[1]: stored offset 35, log start 0, log end 20 (the stored offset is past the log end: the topic " \
           "was deleted and recreated)" in text
    assert "eos offsets reset orders --to earliest" in text


def _run_failing(exc: BaseException, capsys: pytest.CaptureFixture[str], tmp_path: Any) -> tuple[int, dict]:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"pipeline": "p", "topics": ["t"], "kafka_bootstrap": "k:9092",
                                  "spec": "spark_apps.ledger.spec:LEDGER", "checkpoint_dir": str(tmp_path),
                                  "postgres": {"host": "h", "port": 5432, "dbname": "d", "user": "u"}}))

    def run(_config: Any) -> int:
        raise exc

    code = entry.main(["--config", str(config)], run)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("EOS-ERROR "))
    return code, json.loads(line[len("EOS-ERROR "):])


def test_the_claims_data_lost_exits_4(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    code, event = _run_failing(DataLost("p", [LostPartition("t", 0, 4, 10, 50)]), capsys, tmp_path)
    assert (code, event["kind"]) == (EXIT_DATA_LOST, "data_lost")
    assert "t[0]: stored offset 4, log start 10" in event["message"]


class _JavaThrowable:
    """What py4j hands over for a Java exception: class, message and cause by method calls."""

    def __init__(self, name: str, message: str, cause: _JavaThrowable | None = None) -> None:
        self.name, self.message, self.cause = name, message, cause

    def getClass(self) -> Any:  # Java's names, as py4j exposes them
        return type("C", (), {"getName": lambda _self: self.name})()

    def getMessage(self) -> str:
        return self.message

    def getCause(self) -> _JavaThrowable | None:
        return self.cause

    def equals(self, other: Any) -> bool:
        return other is self


class StreamingQueryException(Exception):
    """pyspark's: its text is Spark's query report; the JVM exception is ``_origin``."""

    def __init__(self, text: str, origin: _JavaThrowable) -> None:
        super().__init__(text)
        self._origin = origin


QUERY_REPORT = ("[STREAM_FAILED] Query [id = 1, runId = 2] terminated with exception: see below\n"
                "=== Streaming Query ===\nIdentifier: eos-p [id = 1, runId = 2]\nCurrent Committed Offsets: {}\n")


def test_the_root_cause_is_the_innermost_java_cause_not_the_querys_identifier() -> None:
    inner = _JavaThrowable("java.net.ConnectException", "Connection refused: broker-3:9092")
    origin = _JavaThrowable("org.apache.spark.sql.streaming.StreamingQueryException", "query failed",
                            _JavaThrowable("org.apache.spark.SparkException", "Job aborted", inner))
    cause = entry.root_cause(StreamingQueryException(QUERY_REPORT, origin))
    assert cause == "ConnectException: Connection refused: broker-3:9092"
    # Reached through the Python chain too (app.py raises ``from query.exception()``).
    try:
        raise RuntimeError("streaming query failed: " + QUERY_REPORT) from StreamingQueryException(QUERY_REPORT,
                                                                                                   origin)
    except RuntimeError as wrapped:
        assert entry.root_cause(wrapped) == cause


def test_sparks_data_loss_mid_stream_exits_4_with_the_java_cause(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Any) -> None:
    origin = _JavaThrowable("org.apache.spark.sql.streaming.StreamingQueryException", "query failed",
                            _JavaThrowable("org.apache.spark.sql.kafka010.KafkaIllegalStateException",
                                           "[KAFKA_DATA_LOSS.PARTITION_OFFSET_CHANGED] Some data may have been lost "
                                           "because they are not available in Kafka any more;\nPartition t-0's "
                                           "offset was changed from 300 to 50."))
    code, event = _run_failing(StreamingQueryException(QUERY_REPORT, origin), capsys, tmp_path)
    assert (code, event["kind"]) == (EXIT_DATA_LOST, "data_lost")
    assert "KafkaIllegalStateException: [KAFKA_DATA_LOSS.PARTITION_OFFSET_CHANGED] Some data may have been " \
           "lost because they are not available in Kafka any more; Partition t-0's offset was changed from 300 " \
           "to 50." in event["message"]
    assert "Identifier" not in event["message"] and "eos offsets reset" in event["message"]


def test_any_other_java_failure_exits_1_naming_its_cause(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    origin = _JavaThrowable("org.apache.spark.SparkException", "Job aborted",
                            _JavaThrowable("java.lang.OutOfMemoryError", "Java heap space"))
    code, event = _run_failing(StreamingQueryException(QUERY_REPORT, origin), capsys, tmp_path)
    assert (code, event) == (entry.EXIT_FAILED, {"kind": "failed", "message": "OutOfMemoryError: Java heap space"})


def test_a_reset_moves_only_lost_partitions_unless_forced() -> None:
    bounds = {("t", 0): (10, 50), ("t", 1): (0, 20), ("t", 2): (0, 30), ("t", 3): (0, 9)}
    stored = {("t", 0): 4, ("t", 1): 35, ("t", 2): 12}
    moves = plan_moves(stored, bounds, "earliest")
    assert [(m.topic, m.partition, m.from_offset, m.to_offset, m.lost) for m in moves] == [
        ("t", 0, 4, 10, True), ("t", 1, 35, 0, True)]
    assert [(m.partition, m.to_offset) for m in plan_moves(stored, bounds, "latest", only={("t", 0)})] == [(0, 50)]
    forced = plan_moves(stored, bounds, "latest", force=True)
    assert [(m.partition, m.from_offset, m.to_offset, m.lost) for m in forced] == [
        (0, 4, 50, True), (1, 35, 20, True), (2, 12, 30, False)]
    with pytest.raises(ResetRefused, match="no such partition in Kafka: t:7"):
        plan_moves(stored, bounds, "earliest", only={("t", 7)})
    with pytest.raises(ResetRefused, match="--to must be one of"):
        plan_moves(stored, bounds, "somewhere")


def test_offsets_in_an_accepted_gap_are_not_expected() -> None:
    gaps = [{"topic": "t", "partition": 0, "from_offset": 4, "to_offset": 10},
            {"topic": "t", "partition": 1, "from_offset": 35, "to_offset": 0}]  # moved back: skips nothing
    valid = {("t", 0): {2, 3, 4, 9, 10, 11}, ("t", 1): {1, 2}}
    assert without_accepted_gaps(valid, gaps) == {("t", 0): {2, 3, 10, 11}, ("t", 1): {1, 2}}
    assert accepted_gap_offsets(gaps) == 6
