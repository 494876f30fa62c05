"""The committed position a pipeline's asset events carry, and how one position differs from the last."""

from __future__ import annotations

from airflow_provider_eos.utils.committed_position import committed_position, position_change


def _row(topic: str, partition: int, next_offset: int, batch_id: int | None) -> dict:
    return {"topic": topic, "partition": partition, "next_offset": next_offset, "batch_id": batch_id}


def test_no_rows_is_no_position() -> None:
    assert committed_position("ledger", []) is None


def test_the_position_names_every_partition_and_its_batch() -> None:
    position = committed_position("ledger", [_row("b", 10, 7, 3), _row("b", 2, 5, 4), _row("a", 0, 1, None)])
    assert position == {
        "pipeline": "ledger",
        "offsets": {"a": {"0": 1}, "b": {"2": 5, "10": 7}},
        "batch_ids": {"a": {"0": None}, "b": {"2": 4, "10": 3}},
        "batch_id": 4,
    }
    # Partitions sort as numbers, topics as names: the same position always reads the same.
    assert list(position["offsets"]["b"]) == ["2", "10"]


def test_changes() -> None:
    before = {"t": {"0": 10, "1": 20}}
    assert position_change(None, before) == "first"
    assert position_change(before, {"t": {"0": 10, "1": 20}}) is None
    assert position_change(before, {"t": {"0": 11, "1": 20}}) == "advanced"
    assert position_change(before, {"t": {"0": 10, "1": 20, "2": 1}}) == "advanced"  # a new partition
    assert position_change(before, {"t": {"0": 11, "1": 19}}) == "rewound"  # one went back: a restore
    assert position_change(before, {"t": {"0": 10}}) == "rewound"  # one is gone: restored to before it
    assert position_change(before, {"u": {"0": 99}}) == "rewound"
