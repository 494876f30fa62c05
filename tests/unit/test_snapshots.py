"""Pure logic of the snapshot store: manifests, selection, retention, replay gaps."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from airflow_provider_eos.recovery.manifest import SnapshotError, SnapshotManifest, TableState, new_snapshot_id, select
from airflow_provider_eos.recovery.retention import retention_gaps
from airflow_provider_eos.recovery.store import DUMP, MANIFEST, MARKER, SnapshotStore, retention_plan
from airflow_provider_eos.utils.lso_watch import PartitionOffsets
from airflow_provider_eos.utils.pipeline_config import PipelineConfigError, load_pipeline_config
from airflow_provider_eos.utils.stream_stopped import why_not_stopped

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
    from airflow_provider_eos.recovery.store import sha256_file

    saved = []
    for h in range(4):
        m = manifest(h)
        m.dump_sha256 = sha256_file(dump)
        store.save(m, dump)
        saved.append(m)
    (tmp_path / "ledger" / "00000000T000000Z-unfinished").mkdir()  # not the store's: never listed nor deleted
    interrupted = tmp_path / "ledger" / "20260301T110000Z-abcdef"  # a save that died after its marker
    interrupted.mkdir()
    (interrupted / MARKER).write_text("20260301T110000Z-abcdef")
    (interrupted / DUMP).write_bytes(b"PGD")
    assert store.incomplete("ledger") == [interrupted.name]
    assert [m.snapshot_id for m in store.manifests("ledger")] == [m.snapshot_id for m in saved]
    out = store.fetch_dump(saved[0], tmp_path / "copy.pgc")
    assert out.read_bytes() == b"PGDMP-fake"
    (tmp_path / "ledger" / saved[1].snapshot_id / DUMP).write_bytes(b"PGDMP-fakX")
    with pytest.raises(SnapshotError, match="corrupted"):
        store.fetch_dump(saved[1], tmp_path / "copy2.pgc")
    deleted = store.apply_retention("ledger", 2)
    assert sorted(deleted) == sorted([saved[0].snapshot_id, saved[1].snapshot_id, interrupted.name])
    assert sorted(p.name for p in (tmp_path / "ledger").iterdir()) == sorted(
        ["00000000T000000Z-unfinished", saved[2].snapshot_id, saved[3].snapshot_id]
    )
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
    assert "no stop has been requested" in why_not_stopped({"stop_requested_at": None}, 30)
    assert why_not_stopped({"stop_requested_at": now, "seconds_since": 31.0}, 30) is None
    assert "micro-batch 5.0s ago" in why_not_stopped({"stop_requested_at": now, "seconds_since": 5.0}, 30)
    assert why_not_stopped({"stop_requested_at": None, "seconds_since": None}, 30, require_stop_request=False) is None
    # The running lock decides: a connected driver is running however long ago its last batch was.
    running = {"stop_requested_at": now, "seconds_since": 3600.0, "driver_running": True}
    assert "holds the pipeline's running lock" in why_not_stopped(running)
    assert why_not_stopped({**running, "driver_running": False, "seconds_since": 0.5}) is None
    # A supervisor (even one in its restart backoff, with no driver) is not stopped yet: it could restart one.
    supervised = {"stop_requested_at": now, "driver_running": False, "supervisor_running": True}
    assert "supervisor" in why_not_stopped(supervised)
    assert why_not_stopped({**supervised, "supervisor_running": False}) is None


def test_load_pipeline_config(tmp_path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"pipeline": "a", "topics": ["x"], "spec": "m:S"}))
    assert load_pipeline_config(str(tmp_path / "a.json")).pipeline == "a"
    with pytest.raises(PipelineConfigError, match="known pipelines there: a"):
        load_pipeline_config(str(tmp_path / "b.json"))
    with pytest.raises(PipelineConfigError, match="not 'b'"):
        load_pipeline_config(str(tmp_path / "a.json"), pipeline="b")
    with pytest.raises(PipelineConfigError, match="invalid pipeline config"):
        load_pipeline_config({"pipeline": "a", "nope": 1})


# ---------------------------------------------------------------------- store safety (issue 10, section 5)
# Only names that the store had before these checks are imported here, so that this
# section, run against the former store, fails on its assertions rather than on imports.
STORE_MARKER = ".eos-snapshot"
BAD_PIPELINES = ["..", ".", ".hidden", "../x", "a/b", "/abs", "", "x\n", "-dash", "a" * 101, "é"]
BAD_IDS = ["..", "../../escape", "20260301T120000Z-abcdef/../..", "20260301T120000Z-abcdef\n", "latest", "x"]


def _saved_store(tmp_path, hours=(0, 1, 2)):
    store = SnapshotStore(str(tmp_path / "store"))
    dump = tmp_path / "src.pgc"
    dump.write_bytes(b"PGDMP-fake")
    saved = []
    for h in hours:
        m = manifest(h)
        store.save(m, dump)
        saved.append(m)
    return store, dump, saved


def _tree(root) -> list[str]:
    """Every path under root (symlinks listed, never followed)."""
    import os

    out = []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            out.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(out)


@pytest.mark.parametrize("pipeline", BAD_PIPELINES)
def test_store_refuses_bad_pipeline_names_on_every_operation(tmp_path, pipeline) -> None:
    store, dump, saved = _saved_store(tmp_path, hours=(0,))
    before = _tree(tmp_path)
    forged = manifest(5, pipeline=pipeline)
    operations = {
        "manifests": lambda: store.manifests(pipeline),
        "incomplete": lambda: store.incomplete(pipeline),
        "select": lambda: store.select(pipeline, "latest"),
        "save": lambda: store.save(forged, dump),
        "dump_path": lambda: store.dump_path(forged),
        "fetch_dump": lambda: store.fetch_dump(forged, tmp_path / "out.pgc"),
        "delete": lambda: store.delete(pipeline, saved[0].snapshot_id),
        "apply_retention": lambda: store.apply_retention(pipeline, 1),
    }
    accepted = []
    for name, operation in operations.items():
        try:
            operation()
        except SnapshotError as exc:
            assert "invalid pipeline name" in str(exc), (name, str(exc))
        else:
            accepted.append(name)
    assert accepted == [], f"pipeline {pipeline!r} accepted by {accepted}"
    assert _tree(tmp_path) == before  # nothing written or deleted anywhere


@pytest.mark.parametrize("snapshot_id", BAD_IDS)
def test_store_refuses_bad_snapshot_ids_on_every_operation(tmp_path, snapshot_id) -> None:
    store, dump, saved = _saved_store(tmp_path, hours=(0,))
    # What a traversal would reach: a sibling of the store and the store's root.
    (tmp_path / "escape").mkdir()
    (tmp_path / "escape" / "precious").write_text("keep me")
    before = _tree(tmp_path)
    forged = manifest(5)
    forged.snapshot_id = snapshot_id
    operations = {
        "save": lambda: store.save(forged, dump),
        "dump_path": lambda: store.dump_path(forged),
        "fetch_dump": lambda: store.fetch_dump(forged, tmp_path / "out.pgc"),
        "delete": lambda: store.delete("ledger", snapshot_id),
    }
    accepted = []
    for name, operation in operations.items():
        try:
            operation()
        except SnapshotError as exc:
            assert "invalid snapshot id" in str(exc), (name, str(exc))
        except OSError:
            accepted.append(name)  # it tried to touch the path
        else:
            accepted.append(name)
    assert accepted == [], f"snapshot id {snapshot_id!r} accepted by {accepted}"
    assert _tree(tmp_path) == before
    assert store.select("ledger", "latest").snapshot_id == saved[0].snapshot_id


def test_pipeline_names_need_a_letter_or_digit_first() -> None:
    from spark_apps.eos_stream.run.config import ConfigError, from_dict

    for bad in ("..", ".", ".hidden", "-x", "_x", "a/b"):
        with pytest.raises(ConfigError, match="pipeline name"):
            from_dict({"pipeline": bad, "topics": ["t"], "spec": "m:S"}).validate()
        with pytest.raises(PipelineConfigError, match="invalid pipeline config"):
            load_pipeline_config({"pipeline": bad, "topics": ["t"], "spec": "m:S"})
    for good in ("a", "0", "ledger.v2", "a..b", "A-b_c.1", "x" * 100):
        assert from_dict({"pipeline": good, "topics": ["t"], "spec": "m:S"}).validate().pipeline == good


def test_retention_deletes_only_what_the_store_created(tmp_path) -> None:
    store, _dump, saved = _saved_store(tmp_path)
    pipeline_dir = tmp_path / "store" / "ledger"
    # A directory that looks like an old snapshot but was not made by the store.
    foreign = pipeline_dir / "20200101T000000Z-aaaaaa"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a snapshot")
    # Somebody's directory elsewhere, holding what looks like a snapshot, linked in.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lured = manifest(-5)
    (elsewhere / "manifest.json").write_text(lured.to_json().replace(lured.snapshot_id, "20200101T000000Z-bbbbbb"))
    (elsewhere / DUMP).write_bytes(b"someone else's data")
    (elsewhere / STORE_MARKER).write_text("")
    link = pipeline_dir / "20200101T000000Z-bbbbbb"
    link.symlink_to(elsewhere, target_is_directory=True)
    # A symlink to a single file, and a non-snapshot name.
    (pipeline_dir / "20200101T000000Z-cccccc").symlink_to(elsewhere / DUMP)
    (pipeline_dir / "README").write_text("hands off")
    outside_before = _tree(elsewhere)

    assert [m.snapshot_id for m in store.manifests("ledger")] == [m.snapshot_id for m in saved]
    assert store.incomplete("ledger") == []
    deleted = store.apply_retention("ledger", 1)

    assert sorted(deleted) == sorted(m.snapshot_id for m in saved[:2])
    left = sorted(p.name for p in pipeline_dir.iterdir())
    assert left == sorted(["20200101T000000Z-aaaaaa", "20200101T000000Z-bbbbbb", "20200101T000000Z-cccccc",
                           "README", saved[2].snapshot_id])
    assert (foreign / "notes.txt").read_text() == "not a snapshot"
    assert link.is_symlink() and _tree(elsewhere) == outside_before
    assert (elsewhere / DUMP).read_bytes() == b"someone else's data"
    # Asked directly, the store refuses them too.
    with pytest.raises(SnapshotError, match="did not create it"):
        store.delete("ledger", "20200101T000000Z-aaaaaa")
    with pytest.raises(SnapshotError, match="symlink"):
        store.delete("ledger", "20200101T000000Z-bbbbbb")
    assert (foreign / "notes.txt").exists() and _tree(elsewhere) == outside_before


def test_a_snapshot_directory_with_foreign_files_is_left_in_place(tmp_path) -> None:
    store, _dump, saved = _saved_store(tmp_path, hours=(0, 1))
    extra = tmp_path / "store" / "ledger" / saved[0].snapshot_id / "added-by-hand.txt"
    extra.write_text("mine")
    assert store.apply_retention("ledger", 1) == []
    assert extra.read_text() == "mine"
    # Nothing in it was deleted: the snapshot is still whole and selectable.
    assert [m.snapshot_id for m in store.manifests("ledger")] == [m.snapshot_id for m in saved]
    with pytest.raises(SnapshotError, match=r"entries the store did not write: \['added-by-hand.txt'\]"):
        store.delete("ledger", saved[0].snapshot_id)


def test_manifest_that_names_another_snapshot_or_pipeline_is_ignored(tmp_path) -> None:
    store, _dump, saved = _saved_store(tmp_path, hours=(0,))
    copy = tmp_path / "store" / "ledger" / "20260301T150000Z-ffffff"
    copy.mkdir()
    (copy / "manifest.json").write_text(saved[0].to_json())
    (copy / DUMP).write_bytes(b"PGDMP-fake")
    other = manifest(4, pipeline="payments")
    other_dir = tmp_path / "store" / "ledger" / other.snapshot_id
    other_dir.mkdir()
    (other_dir / "manifest.json").write_text(other.to_json())
    assert [m.snapshot_id for m in store.manifests("ledger")] == [saved[0].snapshot_id]


def test_symlinked_pipeline_directory_is_refused(tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "ledger").symlink_to(outside, target_is_directory=True)
    store = SnapshotStore(str(tmp_path / "store"))
    dump = tmp_path / "src.pgc"
    dump.write_bytes(b"PGDMP-fake")
    with pytest.raises(SnapshotError, match="symlink"):
        store.save(manifest(0), dump)
    with pytest.raises(SnapshotError, match="symlink"):
        store.manifests("ledger")
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("as_url", [False, True])
def test_local_store_is_private_whatever_the_umask(tmp_path, as_url) -> None:
    import os
    import stat

    base = tmp_path / "deployment" / "store"
    old = os.umask(0)
    try:
        store = SnapshotStore(f"file://{base}" if as_url else str(base))
        dump = tmp_path / "src.pgc"
        dump.write_bytes(b"PGDMP-fake")
        m = manifest(0)
        target = Path(str(store.save(m, dump)).removeprefix("file://"))
        copy = store.fetch_dump(m, tmp_path / "fetched.pgc")
        # A pipeline directory an older store left world-readable is tightened too.
        (base / "older").mkdir(mode=0o755)
        store.save(manifest(1, pipeline="older"), dump)
    finally:
        os.umask(old)

    def mode(path) -> int:
        return stat.S_IMODE(os.lstat(path).st_mode)

    assert target.parent.parent == base
    assert {str(p.relative_to(tmp_path)): oct(mode(p)) for p in (base, base / "ledger", target)} == {
        str(p.relative_to(tmp_path)): "0o700" for p in (base, base / "ledger", target)
    }
    files = [target / DUMP, target / MANIFEST, target / STORE_MARKER, copy]
    assert {p.name: oct(mode(p)) for p in files} == {p.name: "0o600" for p in files}
    assert oct(mode(base / "older")) == "0o700"
    assert sorted(p.name for p in target.iterdir()) == sorted([DUMP, MANIFEST, STORE_MARKER])


def test_a_store_root_others_can_write_to_is_refused(tmp_path) -> None:
    """Issue 22 §5: the store is a trust boundary; whoever can write there can plant a snapshot."""
    import os

    root = tmp_path / "store"
    store = SnapshotStore(str(root))
    dump = tmp_path / "src.pgc"
    dump.write_bytes(b"PGDMP-fake")
    store.save(manifest(0), dump)
    assert len(store.manifests("ledger")) == 1
    for mode, who in ((0o777, "its group and every user"), (0o707, "every user"), (0o770, "its group")):
        os.chmod(root, mode)
        for action in (lambda: store.select("ledger", "latest"), lambda: store.save(manifest(1), dump),
                       lambda: store.fetch_dump(manifest(0), tmp_path / "x.pgc")):
            with pytest.raises(SnapshotError, match=rf"refusing snapshot store {root}: its mode 0{mode:o} lets {who} "
                                                    rf"write to it\..*chmod go-w {root}"):
                action()
    os.chmod(root, 0o750)  # readable by the group is the deployment's choice
    assert store.select("ledger", "latest")
    if os.geteuid() == 0:  # only root can give the store away to test it
        os.chown(root, 4242, -1)
        with pytest.raises(SnapshotError, match=rf"owned by uid 4242, not by this process's user \(uid 0\).*"
                                                rf"chown 0 {root}"):
            store.select("ledger", "latest")
        os.chown(root, 0, -1)
    # A directory above the store that others may write to (without the sticky bit of /tmp) is refused too.
    os.chmod(tmp_path, 0o777)
    try:
        with pytest.raises(SnapshotError, match=rf"{tmp_path} above it \(mode 0777\)"):
            store.select("ledger", "latest")
        os.chmod(tmp_path, 0o1777)
        assert store.select("ledger", "latest")
    finally:
        os.chmod(tmp_path, 0o700)


def test_a_manifest_of_another_database_is_refused() -> None:
    from airflow_provider_eos.recovery.manifest import identity_problem

    target = {"database": "eos", "database_oid": "16384", "system_identifier": "7711896226601803066"}
    m = manifest(0)
    m.identity = dict(target)
    assert identity_problem(m, target) is None
    assert SnapshotManifest.from_json(m.to_json()).identity == target
    other_cluster = {**target, "system_identifier": "7000000000000000001"}
    problem = identity_problem(m, other_cluster)
    assert problem and "system_identifier '7711896226601803066' (the target's is '7000000000000000001')" in problem
    assert "allow_other_database" in problem
    assert "database_oid '16384'" in (identity_problem(m, {**target, "database_oid": "99"}) or "")
    # The role may not read pg_control_system(): the parts both sides know are compared.
    assert identity_problem(m, {"database": "eos", "database_oid": "16384"}) is None
    # A manifest from before identities: its database name decides.
    old = SnapshotManifest.from_json(json.dumps({k: v for k, v in json.loads(manifest(0).to_json()).items()
                                                 if k != "identity"}))
    assert old.identity == {} and identity_problem(old, target) is None
    assert "database 'eos' (the target's is 'prod')" in (identity_problem(old, {**target, "database": "prod"}) or "")
