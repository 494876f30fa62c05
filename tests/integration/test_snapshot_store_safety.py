"""Snapshots are not an open door (issue 10, section 5), through the real
SnapshotOperator (pg_dump of a real pipeline schema on the local PostgreSQL):
the store it creates is private (0700 directories, 0600 files) under a permissive
umask, its retention deletes only snapshot directories it created (never a
foreign directory, a symlink or what a symlink points to), and a pipeline name
that would leave the store is refused before anything is written.

The store's path checks themselves are unit-tested in tests/unit/test_snapshots.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import psycopg2
import pytest
from airflow.sdk.exceptions import AirflowException
from psycopg2 import sql

from airflow_provider_eos.operators.snapshot import SnapshotOperator
from airflow_provider_eos.recovery.manifest import SnapshotManifest
from airflow_provider_eos.recovery.store import DUMP, MANIFEST, SnapshotStore
from spark_apps.eos_stream.records.spec import load_spec
from spark_apps.eos_stream.run.config import from_dict
from spark_apps.eos_stream.run.preflight import create_targets, delivery_mode, ensure_meta_tables
from tests.streaming import pipeline_config

pytestmark = pytest.mark.integration

PG_CONN = "eos_store_safety_pg"
PG_BIN = "/usr/lib/postgresql/15/bin"
MARKER = ".eos-snapshot"  # the store's marker; spelled out so this file imports only long-standing names


@pytest.fixture
def pipeline(stack, pg_dsn, tmp_path, unique_name, monkeypatch):
    """An empty ledger pipeline (target and bookkeeping tables, no Spark run) and its config file."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{PG_CONN.upper()}", json.dumps({
        "conn_type": "postgres", "host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
        "login": stack["EOS_PG_USER"], "password": stack["EOS_PG_PASSWORD"], "schema": stack["EOS_PG_DB"]}))
    name = f"safe{unique_name}"
    config = pipeline_config(stack, tmp_path, name)
    app_config = from_dict(config).validate()
    spec = load_spec(app_config.spec)
    conn = psycopg2.connect(pg_dsn)
    try:
        ensure_meta_tables(conn, app_config.meta_schema)
        create_targets(conn, spec, app_config.target_schema, delivery_mode(app_config, spec))
        config_file = tmp_path / f"{name}.json"
        config_file.write_text(json.dumps(config))
        yield {"name": name, "config": config, "config_file": config_file}
    finally:
        conn.rollback()
        conn.autocommit = True
        with conn.cursor() as cur:
            for schema in (app_config.target_schema, app_config.meta_schema):
                cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        conn.close()


def _snapshot(config_source, store: Path, keep_last: int) -> dict:
    return SnapshotOperator(
        task_id="snap", pipeline_config=config_source, snapshot_store=str(store), postgres_conn_id=PG_CONN,
        keep_last=keep_last, pg_bin_dir=PG_BIN,
    ).execute({"run_id": "store-safety"})


def _mode(path: Path) -> str:
    return oct(stat.S_IMODE(os.lstat(path).st_mode))


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_operator_store_is_private_and_retention_spares_what_it_did_not_create(pipeline, tmp_path) -> None:
    store = tmp_path / "deployment" / "snapshots"  # does not exist yet: the operator creates it
    name = pipeline["name"]
    old_umask = os.umask(0)  # the most permissive: every bit the store does not pin would show
    try:
        first = _snapshot(str(pipeline["config_file"]), store, keep_last=1)
        pipeline_dir = store / name
        # Planted beside the store's snapshot, all "older" than it by name:
        foreign = pipeline_dir / "20000101T000000Z-aaaaaa"  # id-shaped, not the store's
        foreign.mkdir()
        (foreign / "notes.txt").write_text("not a snapshot")
        elsewhere = tmp_path / "elsewhere"  # somebody's data, made to look like a snapshot, linked in
        elsewhere.mkdir()
        lure = SnapshotManifest.from_json((pipeline_dir / first["snapshot_id"] / MANIFEST).read_text())
        lure.snapshot_id, lure.created_at = "20000101T000000Z-bbbbbb", "2000-01-01T00:00:00+00:00"
        (elsewhere / MANIFEST).write_text(lure.to_json())
        (elsewhere / DUMP).write_bytes(b"someone else's data")
        (elsewhere / MARKER).write_text("")
        (pipeline_dir / "20000101T000000Z-bbbbbb").symlink_to(elsewhere, target_is_directory=True)
        (pipeline_dir / "README").write_text("hands off")
        elsewhere_before = _tree(elsewhere)

        second = _snapshot(str(pipeline["config_file"]), store, keep_last=1)
    finally:
        os.umask(old_umask)

    print(f"\nretention deleted {second['retention_deleted']}; left: {sorted(p.name for p in pipeline_dir.iterdir())}")
    assert second["retention_deleted"] == [first["snapshot_id"]]
    assert sorted(p.name for p in pipeline_dir.iterdir()) == sorted(
        ["20000101T000000Z-aaaaaa", "20000101T000000Z-bbbbbb", "README", second["snapshot_id"]]
    )
    assert (foreign / "notes.txt").read_text() == "not a snapshot"
    assert (pipeline_dir / "20000101T000000Z-bbbbbb").is_symlink()
    assert _tree(elsewhere) == elsewhere_before and (elsewhere / DUMP).read_bytes() == b"someone else's data"
    # The lure is not a snapshot of this pipeline: a restore could never pick it.
    assert [m.snapshot_id for m in SnapshotStore(str(store)).manifests(name)] == [second["snapshot_id"]]

    snapshot_dir = pipeline_dir / second["snapshot_id"]
    modes = {str(p.relative_to(tmp_path)): _mode(p) for p in (store, pipeline_dir, snapshot_dir)}
    modes |= {str(p.relative_to(tmp_path)): _mode(p) for p in snapshot_dir.iterdir()}
    print(f"modes under umask 0: {modes}")
    expected = {str(p.relative_to(tmp_path)): "0o700" for p in (store, pipeline_dir, snapshot_dir)}
    expected |= {str((snapshot_dir / n).relative_to(tmp_path)): "0o600" for n in (DUMP, MANIFEST, MARKER)}
    assert modes == expected
    assert (snapshot_dir / DUMP).stat().st_size == second["dump_bytes"] > 0


@pytest.mark.parametrize("bad_name", ["..", ".hidden", "-x"])
def test_operator_refuses_a_pipeline_name_that_would_leave_the_store(pipeline, tmp_path, bad_name) -> None:
    store = tmp_path / "deployment" / "snapshots"
    store.mkdir(parents=True)
    before = _tree(tmp_path)
    config = {**pipeline["config"], "pipeline": bad_name}
    with pytest.raises(AirflowException, match="pipeline name"):
        _snapshot(config, store, keep_last=1)
    assert _tree(tmp_path) == before
