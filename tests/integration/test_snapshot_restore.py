"""Snapshot and restore against the real stack: a round trip validated by its
manifest, and every refusal (retention gap, corrupted file, bad params, a
concurrent recovery) leaves the target untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowException
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg2 import sql

from airflow_provider_eos.hooks.pg_tools import PgToolsHook
from airflow_provider_eos.operators.replay import RetentionCheckOperator
from airflow_provider_eos.operators.restore import RecoveryLockedError, RestoreOperator
from airflow_provider_eos.operators.snapshot import SnapshotOperator
from airflow_provider_eos.recovery.catalog import list_tables
from airflow_provider_eos.recovery.checksums import measure
from airflow_provider_eos.recovery.guards import StreamStillRunningError
from airflow_provider_eos.recovery.lock import acquire_lock, holding_lock, release_lock
from airflow_provider_eos.recovery.manifest import SnapshotManifest
from airflow_provider_eos.recovery.retention import RetentionGapError
from airflow_provider_eos.recovery.scratch import SnapshotValidationError, scratch_prefix, validate_in_scratch
from airflow_provider_eos.recovery.store import DUMP, MANIFEST, SnapshotStore
from airflow_provider_eos.state.activity import stream_activity
from airflow_provider_eos.state.stop_requests import set_stop_request
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.streaming import pipeline_config, run_app

pytestmark = pytest.mark.integration

PG_CONN = "eos_snap_test_pg"
KAFKA_CONN = "eos_snap_test_kafka"
PG_BIN = "/usr/lib/postgresql/15/bin"


def connections_env(stack: dict[str, str]) -> dict[str, str]:
    return {
        f"AIRFLOW_CONN_{PG_CONN.upper()}": json.dumps({
            "conn_type": "postgres", "host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
            "login": stack["EOS_PG_USER"], "password": stack["EOS_PG_PASSWORD"], "schema": stack["EOS_PG_DB"]}),
        f"AIRFLOW_CONN_{KAFKA_CONN.upper()}": json.dumps({
            "conn_type": "kafka", "extra": {"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"]}}),
    }


def target_state(hook: PgToolsHook, config: dict) -> dict:
    """Count and checksum of every table of the pipeline, as the snapshot measures them."""
    conn = hook.connect()
    try:
        tables = [(config["target_schema"], t) for t in list_tables(conn, config["target_schema"])]
        operational = ("stream_control", "recovery_locks", "pipeline_epochs", "decided_parts")  # never snapshot
        tables += [(config["meta_schema"], t) for t in list_tables(conn, config["meta_schema"])
                   if t not in operational]
        state = {f"{s}.{t}": v.checksum for (s, t), v in measure(conn, tables).items()}
        conn.rollback()
        return state
    finally:
        conn.close()


@pytest.fixture(scope="module")
def snapped(stack, tmp_path_factory):
    """A pipeline that processed 3000 events (4 partitions) and one snapshot of it."""
    return make_snapped(stack, tmp_path_factory)


def make_snapped(stack, tmp_path_factory) -> dict:
    """The body of ``snapped``, for other modules' fixtures of their own pipeline."""
    import os
    import uuid

    name = f"snap{uuid.uuid4().hex[:8]}"
    tmp = tmp_path_factory.mktemp(name)
    os.environ.update(connections_env(stack))
    config = pipeline_config(stack, tmp, name)
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=4)
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 3000, topic=config["topics"][0], abort_every=4, malformed=2,
                   seed=3, transactional_id=f"g{name}")
    run = run_app(config, tmp)
    assert run.process.returncode == 0, run.log()[-3000:]
    config_file = tmp / f"{name}.json"
    config_file.write_text(json.dumps(config))
    store = tmp / "store"
    summary = SnapshotOperator(task_id="snap", pipeline_config=str(config_file), snapshot_store=str(store),
                               postgres_conn_id=PG_CONN, keep_last=3, pg_bin_dir=PG_BIN).execute({"run_id": "t"})
    hook = PgToolsHook(postgres_conn_id=PG_CONN, pg_bin_dir=PG_BIN, meta_schema=config["meta_schema"])
    return {"config": config, "config_file": config_file, "store": store, "summary": summary, "hook": hook,
            "tmp": tmp, "state": target_state(hook, config)}


def _restore(snapped, **kwargs) -> RestoreOperator:
    args = {"task_id": "restore", "pipeline_config": str(snapped["config_file"]),
            "snapshot_store": str(snapped["store"]), "postgres_conn_id": PG_CONN, "pg_bin_dir": PG_BIN,
            "quiet_seconds": 0, "release_lock": True, "kafka_config_id": KAFKA_CONN, **kwargs}
    return RestoreOperator(**args)


def _damage(hook: PgToolsHook, config: dict) -> None:
    conn = hook.connect()
    schema = sql.Identifier(config["target_schema"])
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DELETE FROM {}.ledger_events WHERE kafka_offset % 7 = 0").format(schema))
        cur.execute(sql.SQL("INSERT INTO {0}.ledger_events SELECT * FROM {0}.ledger_events LIMIT 50").format(schema))
        cur.execute(sql.SQL("UPDATE {}.account_balances SET balance_cents = balance_cents + 1").format(schema))
    conn.commit()
    conn.close()


def test_manifest_describes_the_dump(snapped) -> None:
    summary, config = snapped["summary"], snapped["config"]
    store = SnapshotStore(snapped["store"])
    manifest = store.select(config["pipeline"], "latest")
    assert manifest.snapshot_id == summary["snapshot_id"]
    tables = {t.qualified: t for t in manifest.tables}
    events = tables[f"{config['target_schema']}.ledger_events"]
    assert events.rows == 3000 and events.role == "target"
    assert tables[f"{config['meta_schema']}.kafka_offsets"].role == "meta"
    assert f"{config['meta_schema']}.stream_control" not in tables  # operational state is not restored
    assert tables[f"{config['meta_schema']}.dead_letters"].rows == 2
    # The offsets in the manifest are the ones in the dumped kafka_offsets table (same snapshot).
    assert sum(manifest.offsets().values()) >= 3002 and len(manifest.offsets()) == 4
    assert (snapped["store"] / config["pipeline"] / manifest.snapshot_id / DUMP).stat().st_size == manifest.dump_bytes
    # What the snapshot measured is what the tables hold (nothing ran since).
    for qualified, table in tables.items():
        assert snapped["state"][qualified] == table.checksum


def test_round_trip_restores_damaged_tables_exactly(snapped) -> None:
    hook, config = snapped["hook"], snapped["config"]
    _damage(hook, config)
    assert target_state(hook, config) != snapped["state"]
    set_stop_request(hook, config["pipeline"], True)
    result = _restore(snapped).execute({"run_id": "roundtrip"})
    # Proven when it was taken: the restore loads the dump once, into the target.
    assert result["proof"].startswith("proven when taken, on PostgreSQL 15"), result["proof"]
    assert result["timings"]["scratch_restore"] == 0.0
    assert result["snapshot_id"] == snapped["summary"]["snapshot_id"]
    assert result["rows_restored"] == sum(snapped["summary"]["tables"].values())
    assert target_state(hook, config) == snapped["state"]
    conn = hook.connect()
    with conn.cursor() as cur:  # the old tables were moved aside and dropped with the commit
        cur.execute("SELECT count(*) FROM pg_namespace WHERE nspname LIKE %s", (f"{config['target_schema']}_old_%",))
        assert cur.fetchone() == (0,)
    conn.close()
    # The stop request (control table) survived the restore.
    assert stream_activity(hook, config["pipeline"])["stop_requested_at"] is not None


def test_a_proof_drops_dead_proofs_scratch_databases_only(snapped, tmp_path) -> None:
    """A worker killed during a proof leaves its scratch database: the next proof of the target
    drops it, and leaves alone the one of a proof still running (its liveness lock is held)."""
    hook, config = snapped["hook"], snapped["config"]
    manifest = SnapshotStore(snapped["store"]).select(config["pipeline"], "latest")
    prefix = scratch_prefix(f"{hook.dbname}/{config['target_schema']}/{config['pipeline']}")
    dead, live = prefix + "deadbeef", prefix + "livebeef"
    admin, running = hook.connect(), hook.connect()
    admin.autocommit = running.autocommit = True
    try:
        with admin.cursor() as cur:
            for name in (dead, live):
                cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        with running.cursor() as cur:  # a proof that is still running holds its database's lock
            cur.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (live,))
        dump = SnapshotStore(snapped["store"]).fetch_dump(manifest, tmp_path / DUMP)
        proven = validate_in_scratch(hook, dump, manifest, owner=f"{hook.dbname}/{config['target_schema']}/"
                                     f"{config['pipeline']}")
        assert proven["leftovers_dropped"] == [dead]
        with admin.cursor() as cur:
            cur.execute("SELECT datname FROM pg_database WHERE starts_with(datname, %s)", (prefix,))
            assert cur.fetchall() == [(live,)]  # its own scratch database is gone too
    finally:
        running.close()
        with admin.cursor() as cur:
            for name in (dead, live):
                cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        admin.close()


def test_a_snapshot_that_would_not_restore_is_never_saved(snapped) -> None:
    """A column whose type lives outside the snapshot's schemas: pg_dump takes the table without
    the type, so the dump cannot restore into an empty database. The proof refuses it when it is
    taken, naming pg_restore's error, and the store keeps only the snapshots it had."""
    hook, config = snapped["hook"], snapped["config"]
    store = SnapshotStore(snapped["store"])
    before = sorted(m.snapshot_id for m in store.manifests(config["pipeline"]))
    mood = sql.Identifier("public", f"eos_mood_{config['pipeline']}")
    balances = sql.Identifier(config["target_schema"], "account_balances")
    conn = hook.connect()
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE TYPE {} AS ENUM ('calm', 'tense')").format(mood))
            cur.execute(sql.SQL("ALTER TABLE {} ADD COLUMN eos_mood {}").format(balances, mood))
        with pytest.raises(SnapshotValidationError, match=r"pg_restore into scratch database failed: .*eos_mood_"):
            SnapshotOperator(task_id="snap", pipeline_config=str(snapped["config_file"]),
                             snapshot_store=str(snapped["store"]), postgres_conn_id=PG_CONN, keep_last=3,
                             pg_bin_dir=PG_BIN).execute({"run_id": "unrestorable"})
        assert sorted(m.snapshot_id for m in store.manifests(config["pipeline"])) == before
    finally:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS eos_mood").format(balances))
            cur.execute(sql.SQL("DROP TYPE IF EXISTS {}").format(mood))
        conn.close()


def test_corrupted_dump_is_refused_and_target_untouched(snapped, tmp_path) -> None:
    hook, config = snapped["hook"], snapped["config"]
    _damage(hook, config)
    damaged = target_state(hook, config)
    store = tmp_path / "store"
    manifest_dir = snapped["store"] / config["pipeline"] / snapped["summary"]["snapshot_id"]
    copy = store / config["pipeline"] / manifest_dir.name
    copy.mkdir(parents=True)
    dump = (manifest_dir / DUMP).read_bytes()
    (copy / DUMP).write_bytes(dump[: len(dump) // 2] + bytes(64) + dump[len(dump) // 2 + 64:])
    (copy / MANIFEST).write_text((manifest_dir / MANIFEST).read_text())
    set_stop_request(hook, config["pipeline"], True)
    with pytest.raises(AirflowException, match="corrupted"):
        _restore(snapped, snapshot_store=str(store)).execute({"run_id": "corrupt"})
    assert target_state(hook, config) == damaged
    # A dump that is intact but does not match its manifest: the swap's own check refuses it
    # inside its transaction, whatever proof the manifest claims...
    (copy / DUMP).write_bytes(dump)
    manifest = SnapshotManifest.from_json((manifest_dir / MANIFEST).read_text())
    assert manifest.proof["dump_sha256"] == manifest.dump_sha256
    manifest.tables[0].checksum = "1:2"
    (copy / MANIFEST).write_text(manifest.to_json())
    with pytest.raises(SnapshotValidationError, match=r"does not match its manifest \(checked in the swap"):
        _restore(snapped, snapshot_store=str(store)).execute({"run_id": "badmanifest"})
    assert target_state(hook, config) == damaged
    # ... and a manifest without a proof (taken before proofs) is proven in a scratch database.
    manifest.proof = {}
    (copy / MANIFEST).write_text(manifest.to_json())
    with pytest.raises(SnapshotValidationError, match=rf"snapshot {manifest.snapshot_id} does not match its "
                       rf"manifest: {manifest.tables[0].qualified}: checksum"):
        _restore(snapped, snapshot_store=str(store)).execute({"run_id": "unproven"})
    assert target_state(hook, config) == damaged


def test_bad_params_give_clear_errors(snapped, tmp_path) -> None:
    with pytest.raises(AirflowException, match="no snapshot with id '20200101T000000Z-abcdef'"):
        _restore(snapped, snapshot="20200101T000000Z-abcdef").execute({"run_id": "x"})
    with pytest.raises(AirflowException, match="no snapshot taken at or before 2001-01-01"):
        _restore(snapped, snapshot="2001-01-01T00:00:00").execute({"run_id": "x"})
    with pytest.raises(AirflowException, match="neither 'latest', a snapshot id"):
        _restore(snapped, snapshot="yesterday").execute({"run_id": "x"})
    missing = snapped["config_file"].parent / "no_such_pipeline.json"
    with pytest.raises(AirflowException, match=r"no pipeline config at .*no_such_pipeline.json; known pipelines"):
        _restore(snapped, pipeline_config=str(missing)).execute({"run_id": "x"})


def test_running_stream_and_concurrent_recovery_are_refused(snapped) -> None:
    hook, config = snapped["hook"], snapped["config"]
    before = target_state(hook, config)
    set_stop_request(hook, config["pipeline"], False)
    with pytest.raises(StreamStillRunningError, match="no stop has been requested"):
        _restore(snapped).execute({"run_id": "running"})
    set_stop_request(hook, config["pipeline"], True)
    key = f"{hook.dbname}/{config['target_schema']}/{config['pipeline']}"
    assert acquire_lock(hook, key, "other-run", 3600)["acquired"]
    try:
        with pytest.raises(RecoveryLockedError, match="lock held by other-run"):
            _restore(snapped).execute({"run_id": "second"})
    finally:
        release_lock(hook, key, "other-run")
    assert target_state(hook, config) == before


def _wait_for_beat_after(hook: PgToolsHook, meta: str, key: str, taken_at: str, seconds: float) -> None:
    """Waits (60 s at most) until the lock's heartbeat is ``seconds`` past ``taken_at``."""
    import time

    deadline = time.monotonic() + 60
    conn = hook.connect()
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            while True:
                cur.execute(sql.SQL("SELECT heartbeat_at > %s::timestamptz + make_interval(secs => %s)"
                                    " FROM {}.recovery_locks WHERE lock_key = %s").format(sql.Identifier(meta)),
                            (taken_at, seconds, key))
                if cur.fetchone() == (True,):
                    return
                assert time.monotonic() < deadline, f"no heartbeat {seconds}s after the lock was taken"
                time.sleep(0.1)
    finally:
        conn.close()


def test_recovery_lock_is_reentrant_fenced_and_taken_over_when_abandoned(stack, tmp_path) -> None:
    """The lock row through a crash: the dead run's rerun re-enters it, a new run
    is refused while the heartbeat is fresh and takes it over once it is stale,
    and the presumed-dead run's next step is fenced off."""
    import os
    import time
    import uuid

    os.environ.update(connections_env(stack))
    meta, key = f"m_lock{uuid.uuid4().hex[:8]}", "db/t/ledger"
    hook = PgToolsHook(postgres_conn_id=PG_CONN, pg_bin_dir=PG_BIN, meta_schema=meta)
    assert acquire_lock(hook, key, "run-a", 2)["acquired"]
    again = acquire_lock(hook, key, "run-a", 2)  # run-a cleared and rerun after its worker died
    assert again["acquired"] and again["taken_over_from"] is None
    # Refused while the heartbeat is fresh: judged with a TTL no pause of this process outlasts.
    refused = acquire_lock(hook, key, "run-b", 600)
    assert not refused["acquired"] and refused["holder"] == "run-a"
    with pytest.raises(RecoveryLockedError, match="lock held by run-a"), holding_lock(hook, key, "run-b", 600):
        pass
    time.sleep(2.5)  # run-a's heartbeat goes stale: it died without its teardown
    taken = acquire_lock(hook, key, "run-b", 2)
    assert taken["acquired"] and taken["taken_over_from"] == "run-a"
    # run-a was only slow, not dead: its next step must not touch the target.
    with pytest.raises(RecoveryLockedError, match="lock held by run-b"), holding_lock(hook, key, "run-a", 60):
        pass
    # A step holding the lock keeps it alive past the TTL, and notices a takeover: once a beat
    # is seen more than the TTL after the lock was taken, another run asking with the same TTL
    # is refused (it would take a lock whose holder stopped beating 4 s ago).
    with holding_lock(hook, key, "run-b", 4) as held:
        _wait_for_beat_after(hook, meta, key, held["heartbeat_at"], 4)
        assert not acquire_lock(hook, key, "run-c", 4)["acquired"]
    with pytest.raises(RecoveryLockedError, match="taken over by another run"), \
            holding_lock(hook, key, "run-b", 60):
        conn = hook.connect()
        with conn.cursor() as cur:  # an operator forcing the lock away mid-step
            cur.execute(sql.SQL("UPDATE {}.recovery_locks SET holder = 'run-c'").format(sql.Identifier(meta)))
        conn.commit()
        conn.close()
    assert release_lock(hook, key, "run-c") and not release_lock(hook, key, "run-c")
    conn = hook.connect()
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(meta)))
    conn.commit()
    conn.close()


def test_a_role_that_may_not_create_databases_saves_unproven_snapshots_their_restore_proves(
        snapped, stack, tmp_path, monkeypatch) -> None:
    """A least-privilege snapshot role (it reads the tables, it may not CREATE DATABASE) still
    takes snapshots, as before proofs: unproven, with a warning; their restore proves them.
    (Before the retention tests: their deleted records would fail its restore's re-check.)"""
    import uuid

    hook, config = snapped["hook"], snapped["config"]
    role, password = f"eos_snapper_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    schemas = sql.SQL(", ").join(map(sql.Identifier, (config["target_schema"], config["meta_schema"])))
    admin = hook.connect()
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(sql.SQL("CREATE ROLE {} LOGIN NOCREATEDB NOSUPERUSER PASSWORD %s").format(
                sql.Identifier(role)), (password,))
            cur.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(schemas, sql.Identifier(role)))
            cur.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(schemas, sql.Identifier(role)))
            cur.execute(sql.SQL("GRANT SELECT ON ALL SEQUENCES IN SCHEMA {} TO {}").format(
                schemas, sql.Identifier(role)))
        monkeypatch.setenv("AIRFLOW_CONN_EOS_SNAP_READER", json.dumps({
            "conn_type": "postgres", "host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
            "login": role, "password": password, "schema": stack["EOS_PG_DB"]}))
        store = tmp_path / "store"
        before = target_state(hook, config)
        summary = SnapshotOperator(task_id="snap", pipeline_config=str(snapped["config_file"]),
                                   snapshot_store=str(store), postgres_conn_id="eos_snap_reader",
                                   pg_bin_dir=PG_BIN).execute({"run_id": "reader"})
        manifest = SnapshotStore(store).select(config["pipeline"], summary["snapshot_id"])
        assert manifest.proof == {} and "proof" not in manifest.timings
        _damage(hook, config)
        set_stop_request(hook, config["pipeline"], True)
        result = _restore(snapped, snapshot_store=str(store)).execute({"run_id": "unproven-reader"})
        assert result["proof"] == "proven in a scratch database beside the swap"
        assert result["timings"]["scratch_restore"] > 0
        assert target_state(hook, config) == before
    finally:
        with admin.cursor() as cur:
            cur.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            cur.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
        admin.close()


def test_retention_gap_fails_before_restore(snapped) -> None:
    hook, config = snapped["hook"], snapped["config"]
    before = target_state(hook, config)
    manifest = SnapshotStore(snapped["store"]).select(config["pipeline"], "latest")
    topic = config["topics"][0]
    needed = manifest.offsets()[(topic, 1)]
    producer = Producer({"bootstrap.servers": config["kafka_bootstrap"]})
    for _ in range(20):  # records after the replay point, so retention can delete part of what it needs
        producer.produce(topic, b"{}", partition=1)
    producer.flush(30)
    admin = AdminClient({"bootstrap.servers": config["kafka_bootstrap"]})
    futures = admin.delete_records([TopicPartition(topic, 1, needed + 10)], request_timeout=30)
    for future in futures.values():
        future.result(30)
    check = RetentionCheckOperator(task_id="retention", pipeline_config=str(snapped["config_file"]),
                                   snapshot="latest", snapshot_store=str(snapped["store"]),
                                   kafka_config_id=KAFKA_CONN, postgres_conn_id=PG_CONN)
    with pytest.raises(RetentionGapError, match=rf"{topic}\[1\]: replay needs offset {needed} but the log starts "
                       rf"at {needed + 10} \(10 records deleted by retention\)"):
        check.execute({"run_id": "gap"})
    assert target_state(hook, config) == before


def test_retention_keeps_the_last_n(snapped) -> None:
    store = SnapshotStore(snapped["store"])
    pipeline = snapped["config"]["pipeline"]
    for _ in range(3):
        SnapshotOperator(task_id="snap", pipeline_config=str(snapped["config_file"]),
                         snapshot_store=str(snapped["store"]), postgres_conn_id=PG_CONN, keep_last=2,
                         pg_bin_dir=PG_BIN).execute({"run_id": "t"})
    kept = store.manifests(pipeline)
    assert len(kept) == 2
    # manifests() is ordered by creation time; ids of one second sort by their random suffix.
    assert sorted(p.name for p in Path(snapped["store"], pipeline).iterdir()) == sorted(m.snapshot_id for m in kept)

