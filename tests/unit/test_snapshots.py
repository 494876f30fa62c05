"""Pure logic of the snapshot store: manifests, selection, retention, replay gaps."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from airflow_provider_eos.lso_lag import PartitionOffsets
from airflow_provider_eos.operators.restore import check_stream_stopped
from airflow_provider_eos.snapshots import (
    DUMP,
    MANIFEST,
    SnapshotError,
    SnapshotManifest,
    SnapshotStore,
    TableState,
    load_pipeline_config,
    new_snapshot_id,
    retention_gaps,
    retention_plan,
    select,
)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


def manifest(hours: float, pipeline: str = "ledger") -> SnapshotManifest:
    at = T0 + timedelta(hours=hours)
    return SnapshotManifest(
        snapshot_id=new_snapshot_id(at), created_at=at.isoformat(), pipeline=pipeline, database="eos",
        target_schema="public", meta_schema="eos", tables=[TableState("public", "t", 3, "3:42")],
        kafka_offsets={"topic": {"0": 10, "1": 7}},
    )


def test_manifest_json_round_trip() -> None:
    m = manifest(0)
    back = SnapshotManifest.from_json(m.to_json())
    assert back == m
    assert back.offsets() == {("topic", 0): 10, ("topic", 1): 7}
    assert back.total_rows == 3


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[]", "not a JSON object"),
    (json.dumps({"format_version": 99}), "format 99 is not supported"),
    (json.dumps({"format_version": 1, "bogus": 1}), "unexpected fields"),
])
def test_bad_manifests_are_rejected(text: str, message: str) -> None:
    with pytest.raises(SnapshotError, match=message):
        SnapshotManifest.from_json(text)


def test_select_latest_id_and_before_timestamp() -> None:
    ms = [manifest(2), manifest(0), manifest(1)]
    assert select(ms, "latest") is ms[0]
    assert select(ms, ms[2].snapshot_id) is ms[2]
    assert select(ms, (T0 + timedelta(minutes=90)).isoformat()) is ms[2]
    assert select(ms, "2026-03-01T13:00:00Z") is ms[2]  # at or before
    assert select(ms, "2026-03-01T12:30:00") is ms[1]  # naive means UTC
    with pytest.raises(SnapshotError, match="no snapshot taken at or before"):
        select(ms, "2026-03-01T11:00:00+00:00")
    with pytest.raises(SnapshotError, match="no snapshot with id"):
        select(ms, "20260301T120000Z-000000")
    with pytest.raises(SnapshotError, match="neither 'latest'"):
        select(ms, "yesterday")
    with pytest.raises(SnapshotError, match="no complete snapshot"):
        select([], "latest")


def test_retention_plan_keeps_newest() -> None:
    ms = [manifest(h) for h in (3, 1, 2, 0)]
    assert [m.created_at for m in retention_plan(ms, 2)] == [ms[3].created_at, ms[1].created_at]
    assert retention_plan(ms, 10) == []
    with pytest.raises(SnapshotError):
        retention_plan(ms, 0)


def test_store_save_list_fetch_retention(tmp_path) -> None:
    store = SnapshotStore(str(tmp_path))
    dump = tmp_path / "src.pgc"
    dump.write_bytes(b"PGDMP-fake")
    from airflow_provider_eos.snapshots import sha256_file

    saved = []
    for h in range(4):
        m = manifest(h)
        m.dump_sha256 = sha256_file(dump)
        store.save(m, dump)
        saved.append(m)
    (tmp_path / "ledger" / "00000000T000000Z-unfinished").mkdir()  # no manifest: never listed
    assert [m.snapshot_id for m in store.manifests("ledger")] == [m.snapshot_id for m in saved]
    out = store.fetch_dump(saved[0], tmp_path / "copy.pgc")
    assert out.read_bytes() == b"PGDMP-fake"
    (tmp_path / "ledger" / saved[1].snapshot_id / DUMP).write_bytes(b"PGDMP-fakX")
    with pytest.raises(SnapshotError, match="corrupted"):
        store.fetch_dump(saved[1], tmp_path / "copy2.pgc")
    deleted = store.apply_retention("ledger", 2)
    assert saved[0].snapshot_id in deleted and "00000000T000000Z-unfinished" in deleted
    assert sorted(p.name for p in (tmp_path / "ledger").iterdir()) == [saved[2].snapshot_id, saved[3].snapshot_id]
    assert (tmp_path / "ledger" / saved[3].snapshot_id / MANIFEST).exists()


def test_object_storage_path_store(tmp_path) -> None:
    store = SnapshotStore(f"file://{tmp_path}/obj")
    dump = tmp_path / "src.pgc"
    dump.write_bytes(b"x" * 10)
    store.save(manifest(0), dump)
    assert len(store.manifests("ledger")) == 1
    assert store.apply_retention("ledger", 1) == []


def test_retention_gaps() -> None:
    kafka = {("t", 0): PartitionOffsets(100, 100, 0), ("t", 1): PartitionOffsets(50, 50, 20),
             ("t", 2): PartitionOffsets(5, 5, 0)}
    gaps = retention_gaps({("t", 0): 40, ("t", 1): 15, ("t", 2): 9, ("gone", 0): 3}, kafka)
    text = [g.describe() for g in gaps]
    assert text[0] == "t[1]: replay needs offset 15 but the log starts at 20 (5 records deleted by retention)"
    assert "beyond the log end 5" in text[1]
    assert "no longer exists" in text[2]
    # A partition never applied starts at 0: a retention start above 0 is a gap too.
    assert [g.partition for g in retention_gaps({}, kafka)] == [1]


def test_stream_stopped_rule() -> None:
    now = T0
    assert "no stop has been requested" in check_stream_stopped({"stop_requested_at": None}, 30, True)
    assert check_stream_stopped({"stop_requested_at": now, "seconds_since": 31.0}, 30, True) is None
    assert "micro-batch 5.0s ago" in check_stream_stopped({"stop_requested_at": now, "seconds_since": 5.0}, 30, True)
    assert check_stream_stopped({"stop_requested_at": None, "seconds_since": None}, 30, False) is None
    # The running lock decides: a connected driver is running however long ago its last batch was.
    running = {"stop_requested_at": now, "seconds_since": 3600.0, "driver_running": True}
    assert "holds the pipeline's running lock" in check_stream_stopped(running, 0, True)
    assert check_stream_stopped({**running, "driver_running": False, "seconds_since": 0.5}, 0, True) is None


def test_load_pipeline_config(tmp_path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"pipeline": "a", "topics": ["x"]}))
    assert load_pipeline_config(str(tmp_path / "a.json")).pipeline == "a"
    with pytest.raises(SnapshotError, match="known pipelines there: a"):
        load_pipeline_config(str(tmp_path / "b.json"))
    with pytest.raises(SnapshotError, match="not 'b'"):
        load_pipeline_config(str(tmp_path / "a.json"), pipeline="b")
    with pytest.raises(SnapshotError, match="invalid pipeline config"):
        load_pipeline_config({"pipeline": "a", "nope": 1})
