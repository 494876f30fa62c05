"""A restore that cannot lose data, against the real stack: it holds the
pipeline's running lock, fences by epoch, refuses to orphan objects it does not
own (and keeps grants when told to go on), can be rolled back exactly, and
re-checks Kafka retention right before its swap commits.

The retention tests open a gap on this module's snapshot, so they run last."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg2 import sql

from airflow_provider_eos.hooks.pg_tools import PgToolsHook
from airflow_provider_eos.operators.replay import RetentionCheckOperator
from airflow_provider_eos.operators.restore import FenceOperator, FinalizeRestoreOperator, RollbackRestoreOperator
from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.recovery import swap
from airflow_provider_eos.recovery.aside import aside_schema_name
from airflow_provider_eos.recovery.catalog import DependentObjectsError
from airflow_provider_eos.recovery.guards import StreamStillRunningError
from airflow_provider_eos.recovery.retention import RetentionGapError
from airflow_provider_eos.recovery.store import DUMP, SnapshotStore
from airflow_provider_eos.state.stop_requests import set_stop_request
from spark_apps.eos_stream.state import fencing
from spark_apps.eos_stream.state.control import AlreadyRunning, hold_running_lock
from tests.integration.test_snapshot_restore import KAFKA_CONN, PG_CONN, _damage, _restore, make_snapped, target_state
from tests.streaming import pg_connect

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def snapped(stack, tmp_path_factory):
    """This module's own pipeline (3000 events, 4 partitions) and one snapshot of it."""
    return make_snapped(stack, tmp_path_factory)


def _epoch(hook: PgToolsHook, config: dict) -> int:
    conn = hook.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s)", (f'"{config["meta_schema"]}"."pipeline_epochs"',))
            if (cur.fetchone() or (None,))[0] is None:
                return 0
            return fencing.current_epoch(cur, config["meta_schema"], config["pipeline"])
    finally:
        conn.close()


def _asides(hook: PgToolsHook, config: dict) -> list[str]:
    conn = hook.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT nspname FROM pg_namespace WHERE starts_with(nspname, %s) ORDER BY 1",
                        (f"{config['target_schema'][:40]}_old_",))
            return [r[0] for r in cur.fetchall()]
    finally:
        conn.close()


def _wait_for_a_new_aside_name(config: dict) -> None:
    """Aside names have one-second resolution: two restores in one second would collide."""
    name = aside_schema_name(config["target_schema"])
    while aside_schema_name(config["target_schema"]) == name:
        time.sleep(0.05)


def test_fence_and_stop_bump_the_epoch_and_snapshots_leave_it_out(snapped) -> None:
    hook, config = snapped["hook"], snapped["config"]
    before = _epoch(hook, config)
    fenced = FenceOperator(task_id="fence", pipeline_config=str(snapped["config_file"]), postgres_conn_id=PG_CONN,
                           request_stop=True, reason="test fence").execute({"run_id": "fence"})
    assert fenced["epoch"] == before + 1 and fenced["stop_requested"]
    stopped = StopPipelineOperator(task_id="stop", pipeline_config=str(snapped["config_file"]), fence=True,
                                   postgres_conn_id=PG_CONN, timeout_seconds=30,
                                   deferrable=True).execute({"run_id": "stop"})
    assert stopped["epoch"] == before + 2 and stopped["driver_running"] is False
    manifest = SnapshotStore(snapped["store"]).select(config["pipeline"], "latest")
    assert f"{config['meta_schema']}.pipeline_epochs" not in {t.qualified for t in manifest.tables}
    # The restore's swap bumps it in its own transaction: a restore can never move it back.
    result = _restore(snapped).execute({"run_id": "epoch"})
    assert result["epoch"] == before + 3 == _epoch(hook, config)


def test_restore_holds_the_running_lock(snapped, stack, monkeypatch) -> None:
    """Refused while a driver holds the running lock; while the restore works, a
    driver cannot start (``hold_running_lock`` is what the app runs at start)."""
    hook, config = snapped["hook"], snapped["config"]
    set_stop_request(hook, config["pipeline"], True)
    _damage(hook, config)
    damaged = target_state(hook, config)
    driver = pg_connect(stack)
    try:
        hold_running_lock(driver, config["pipeline"], wait_seconds=5)
        with pytest.raises(StreamStillRunningError, match="holds the pipeline's running lock"):
            _restore(snapped).execute({"run_id": "driver-runs"})
    finally:
        driver.close()  # the driver's process ends
    assert target_state(hook, config) == damaged

    seen: dict[str, str] = {}
    operator = _restore(snapped)
    swap_in = swap.swap_in

    def starting_driver_during_the_restore(*args, **kwargs):
        """A supervisor restarts the app while the restore works, before its swap."""
        late = pg_connect(stack)
        try:
            hold_running_lock(late, config["pipeline"], wait_seconds=2)
            seen["driver"] = "started"
        except AlreadyRunning as exc:
            seen["driver"] = f"refused: {exc}"
        finally:
            late.close()
        return swap_in(*args, **kwargs)

    monkeypatch.setattr(swap, "swap_in", starting_driver_during_the_restore)
    operator.execute({"run_id": "driver-starts"})
    assert seen["driver"].startswith("refused: another driver of pipeline"), seen
    assert target_state(hook, config) == snapped["state"]
    after = pg_connect(stack)  # released at the end: the next driver starts at once
    try:
        hold_running_lock(after, config["pipeline"], wait_seconds=2)
    finally:
        after.close()


def test_dependents_are_refused_and_grants_survive_the_override(snapped, stack) -> None:
    hook, config = snapped["hook"], snapped["config"]
    target = config["target_schema"]
    views, role = f"v_{uuid.uuid4().hex[:8]}", f"eos_reader_{uuid.uuid4().hex[:8]}"
    owner = f"eos_owner_{uuid.uuid4().hex[:8]}"
    events, balances = (sql.SQL("{}.{}").format(sql.Identifier(target), sql.Identifier(t))
                        for t in ("ledger_events", "account_balances"))
    admin = pg_connect(stack)
    try:
        with admin.cursor() as cur:
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(views)))
            cur.execute(sql.SQL("CREATE VIEW {}.big_events AS SELECT * FROM {} WHERE amount_cents > 0").format(
                sql.Identifier(views), events))
            cur.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(role)))
            cur.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(balances, sql.Identifier(role)))
            cur.execute(sql.SQL("GRANT SELECT, INSERT ON {} TO {} WITH GRANT OPTION").format(
                events, sql.Identifier(role)))
            cur.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(owner)))
            cur.execute(sql.SQL("GRANT USAGE, CREATE ON SCHEMA {} TO {}").format(
                sql.Identifier(target), sql.Identifier(owner)))
            cur.execute(sql.SQL("ALTER TABLE {} OWNER TO {}").format(balances, sql.Identifier(owner)))
        set_stop_request(hook, config["pipeline"], True)
        _damage(hook, config)
        damaged = target_state(hook, config)
        with pytest.raises(DependentObjectsError, match=rf"{views}\.big_events \(view\)"):
            _restore(snapped).execute({"run_id": "dependents"})
        assert target_state(hook, config) == damaged
        # The swap checks again under its own locks (a view made after the operator's check).
        manifest = SnapshotStore(snapped["store"]).select(config["pipeline"], "latest")
        dump = snapped["store"] / config["pipeline"] / manifest.snapshot_id / DUMP
        with pytest.raises(DependentObjectsError, match=rf"{views}\.big_events \(view\)"):
            swap.swap_in(hook, dump, manifest, aside_schema_name(target))
        assert target_state(hook, config) == damaged and not _asides(hook, config)

        result = _restore(snapped, allow_dependents=True, keep_old=True).execute({"run_id": "override"})
        assert target_state(hook, config) == snapped["state"]
        with admin.cursor() as cur:
            cur.execute("SELECT has_table_privilege(%s, %s, 'SELECT'), has_table_privilege(%s, %s, 'INSERT'),"
                        " has_table_privilege(%s, %s, 'INSERT WITH GRANT OPTION'),"
                        " has_table_privilege(%s, %s, 'DELETE')",
                        (role, f'"{target}"."account_balances"', role, f'"{target}"."account_balances"',
                         role, f'"{target}"."ledger_events"', role, f'"{target}"."ledger_events"'))
            assert cur.fetchone() == (True, False, True, False)
            cur.execute("SELECT relname, relowner::regrole::text FROM pg_class WHERE relnamespace = %s::regnamespace"
                        " AND relname IN ('ledger_events', 'account_balances') ORDER BY 1", (target,))
            assert cur.fetchall() == [("account_balances", owner), ("ledger_events", hook.connection.login)]
            # The view stays on the old table, now in the aside schema.
            cur.execute("SELECT DISTINCT n.nspname FROM pg_depend d JOIN pg_rewrite r ON r.oid = d.objid"
                        " JOIN pg_class c ON c.oid = d.refobjid JOIN pg_namespace n ON n.oid = c.relnamespace"
                        " WHERE r.ev_class = to_regclass(%s) AND c.relname = 'ledger_events'",
                        (f'"{views}"."big_events"',))
            assert cur.fetchall() == [(result["aside_schema"],)]
        finalize = {"task_id": "finalize", "pipeline_config": str(snapped["config_file"]),
                    "postgres_conn_id": PG_CONN, "aside_schema": result["aside_schema"]}
        with pytest.raises(DependentObjectsError, match=rf"{views}\.big_events \(view\)"):
            FinalizeRestoreOperator(**finalize).execute({"run_id": "override"})
        done = FinalizeRestoreOperator(**finalize, allow_dependents=True).execute({"run_id": "override"})
        assert done["dropped"] and done["dependents_dropped"] == [f"{views}.big_events (view)"]
        assert not _asides(hook, config)
    finally:
        with admin.cursor() as cur:
            cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(views)))
            cur.execute("SELECT rolname FROM pg_roles WHERE rolname IN (%s, %s)", (role, owner))
            for (name,) in cur.fetchall():  # their tables back to us, their grants gone, wherever they went
                cur.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(sql.Identifier(name)))
                cur.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
                cur.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))
        admin.close()


def test_rollback_puts_the_old_state_back_exactly(snapped) -> None:
    hook, config = snapped["hook"], snapped["config"]
    set_stop_request(hook, config["pipeline"], True)
    _damage(hook, config)
    before = target_state(hook, config)  # includes kafka_offsets: data and replay point
    assert before != snapped["state"]
    _wait_for_a_new_aside_name(config)
    result = _restore(snapped, keep_old=True).execute({"run_id": "to-roll-back"})
    aside = result["aside_schema"]
    assert aside and not result["aside_reused"] and target_state(hook, config) == snapped["state"]
    _half_replay(hook, config)
    # The run is cleared and its restore rerun: the aside must still hold the state from
    # before the run, not a copy of the snapshot.
    _wait_for_a_new_aside_name(config)
    rerun = _restore(snapped, keep_old=True).execute({"run_id": "to-roll-back"})
    assert rerun["aside_schema"] == aside and rerun["aside_reused"]
    assert target_state(hook, config) == snapped["state"] and _asides(hook, config).count(aside) == 1
    _half_replay(hook, config)
    epoch = _epoch(hook, config)
    rollback = {"task_id": "rollback", "pipeline_config": str(snapped["config_file"]), "postgres_conn_id": PG_CONN,
                "aside_schema": aside}
    done = RollbackRestoreOperator(**rollback).execute({"run_id": "to-roll-back"})
    assert done["rolled_back"] and done["epoch"] == epoch + 1 == _epoch(hook, config)
    assert sorted(done["moved_back"]) == sorted(snapped["state"]) == sorted(done["restored_dropped"])
    assert target_state(hook, config) == before
    again = RollbackRestoreOperator(**rollback).execute({"run_id": "to-roll-back"})
    assert again["rolled_back"] is False and again["already_rolled_back_at"]
    assert target_state(hook, config) == before
    assert FinalizeRestoreOperator(task_id="finalize", pipeline_config=str(snapped["config_file"]),
                                   postgres_conn_id=PG_CONN, aside_schema=aside).execute({})["dropped"]
    assert aside not in _asides(hook, config)
    # Never a schema that is not this target's aside.
    with pytest.raises(Exception, match="is not an aside schema"):
        RollbackRestoreOperator(**{**rollback, "aside_schema": config["meta_schema"]}).execute({})
    with pytest.raises(Exception, match="is not an aside schema"):
        FinalizeRestoreOperator(**{**rollback, "task_id": "f", "aside_schema": config["target_schema"]}).execute({})


def _half_replay(hook: PgToolsHook, config: dict) -> None:
    """What a replay that failed half-way leaves: some rows and offsets moved on."""
    conn = hook.connect()
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DELETE FROM {}.ledger_events WHERE kafka_offset % 3 = 0").format(
            sql.Identifier(config["target_schema"])))
        cur.execute(sql.SQL("UPDATE {}.kafka_offsets SET next_offset = next_offset + 5").format(
            sql.Identifier(config["meta_schema"])))
    conn.commit()
    conn.close()


def test_finalize_sweeps_only_this_targets_old_asides(stack, tmp_path) -> None:
    import os

    from tests.integration.test_snapshot_restore import connections_env
    from tests.streaming import pipeline_config

    os.environ.update(connections_env(stack))
    name = f"sweep{uuid.uuid4().hex[:8]}"
    config = pipeline_config(stack, tmp_path, name)
    target = config["target_schema"]
    old, fresh = f"{target}_old_20200101t000000", aside_schema_name(target)
    foreign = [f"{target}_old_2020", f"{target}_old_20200101t000000x", f"{target}x_old_20200101t000000"]
    admin = pg_connect(stack)
    try:
        with admin.cursor() as cur:
            for schema in [old, fresh, *foreign]:
                cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            cur.execute(sql.SQL("CREATE TABLE {}.ledger_events (id int)").format(sql.Identifier(old)))
        result = FinalizeRestoreOperator(task_id="finalize", pipeline_config=config, postgres_conn_id=PG_CONN,
                                         aside_schema=fresh, retention_days=30).execute({})
        assert result["dropped"] and result["swept"] == {"dropped": [old], "kept_with_dependents": []}
        with admin.cursor() as cur:
            cur.execute("SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s) ORDER BY 1",
                        ([old, fresh, *foreign],))
            assert [r[0] for r in cur.fetchall()] == sorted(foreign)
    finally:
        with admin.cursor() as cur:
            for schema in [old, fresh, *foreign]:
                cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        admin.close()


def _open_gap(config: dict, manifest, partition: int, deleted: int = 10) -> int:
    """Records past the snapshot's offset on ``partition``, then ``delete_records`` into what a replay needs."""
    topic = config["topics"][0]
    needed = manifest.offsets()[(topic, partition)]
    producer = Producer({"bootstrap.servers": config["kafka_bootstrap"]})
    for _ in range(deleted + 10):
        producer.produce(topic, b"{}", partition=partition)
    producer.flush(30)
    admin = AdminClient({"bootstrap.servers": config["kafka_bootstrap"]})
    for future in admin.delete_records([TopicPartition(topic, partition, needed + deleted)],
                                       request_timeout=30).values():
        future.result(30)
    return needed


def test_retention_gap_after_the_check_fails_the_restore_before_the_swap(snapped) -> None:
    hook, config = snapped["hook"], snapped["config"]
    set_stop_request(hook, config["pipeline"], True)
    _damage(hook, config)
    damaged, epoch, asides = target_state(hook, config), _epoch(hook, config), _asides(hook, config)
    check = RetentionCheckOperator(task_id="retention", pipeline_config=str(snapped["config_file"]),
                                   snapshot="latest", snapshot_store=str(snapped["store"]),
                                   kafka_config_id=KAFKA_CONN, postgres_conn_id=PG_CONN)
    assert check.execute({"run_id": "gap"})["gaps"] == []
    manifest = SnapshotStore(snapped["store"]).select(config["pipeline"], "latest")
    topic = config["topics"][0]
    needed = _open_gap(config, manifest, partition=2)
    with pytest.raises(RetentionGapError, match=rf"re-checked at the swap.*{topic}\[2\]: replay needs offset "
                       rf"{needed} but the log starts at {needed + 10}"):
        _restore(snapped).execute({"run_id": "gap"})
    assert target_state(hook, config) == damaged  # rolled back: tables, offsets
    assert _epoch(hook, config) == epoch and _asides(hook, config) == asides  # the bump and the move too


def test_retention_gap_during_the_restore_fails_it(snapped, monkeypatch) -> None:
    """The gap opens while the restore works (between its start and its swap)."""
    hook, config = snapped["hook"], snapped["config"]
    manifest = SnapshotStore(snapped["store"]).select(config["pipeline"], "latest")
    damaged = target_state(hook, config)
    operator = _restore(snapped, keep_old=True)
    swap_in = swap.swap_in

    def gap_opens_meanwhile(*args, **kwargs):
        _open_gap(config, manifest, partition=3, deleted=5)
        return swap_in(*args, **kwargs)

    monkeypatch.setattr(swap, "swap_in", gap_opens_meanwhile)
    with pytest.raises(RetentionGapError, match=rf"{config['topics'][0]}\[3\]: replay needs offset"):
        operator.execute({"run_id": "gap-meanwhile"})
    assert target_state(hook, config) == damaged
