"""Issue 22 §5 on the real stack, without Spark (the direct replay engine writes):
a restore puts back only what it can (tests 7 and 8 of the issue), the client
tools never get a secret on their command line; and from §4, every session sets
TCP keepalives and a fence never waits forever for the pipeline's lock (test 5
of the issue, with a real two_phase driver, is in test_two_phase.py)."""

from __future__ import annotations

import json
import os
import uuid

import pytest
from psycopg2 import sql

from airflow_provider_eos.operators.replay import ReplayOperator
from airflow_provider_eos.operators.restore import RollbackRestoreOperator
from airflow_provider_eos.operators.snapshot import SnapshotOperator
from airflow_provider_eos.recovery.store import SnapshotStore
from airflow_provider_eos.state.stop_requests import set_stop_request
from spark_apps.eos_stream.records.spec import load_spec
from spark_apps.eos_stream.run.config import from_dict
from spark_apps.eos_stream.run.preflight import create_targets, delivery_mode, ensure_meta_tables
from spark_apps.eos_stream.sink.postgres import connect as app_connect
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.helpers.cmdline import CmdlineWatch
from tests.integration.test_snapshot_restore import KAFKA_CONN, PG_BIN, PG_CONN, _restore, connections_env, target_state
from tests.streaming import pg_connect, pipeline_config

pytestmark = pytest.mark.integration

EVENTS_ONLY, WITH_BALANCES = "spark_apps.ledger.spec:LEDGER_EVENTS_ONLY", "spark_apps.ledger.spec:LEDGER"
# The target connection of this module carries an SSL key password too (sslmode=prefer on a
# server without TLS: libpq accepts it and never needs it); it must never reach a command line.
SSL_KEY_PASSWORD = f"keypw-{uuid.uuid4().hex[:12]}"
PG_KEYPW = "eos_guard_keypw_pg"


@pytest.fixture
def pipeline(stack, tmp_path):
    """A ledger pipeline writing only ``ledger_events`` (its DDL creates ``account_balances``
    too, empty), 600 events applied by the direct engine, and one snapshot of it."""
    os.environ.update(connections_env(stack))
    os.environ[f"AIRFLOW_CONN_{PG_KEYPW.upper()}"] = json.dumps({
        "conn_type": "postgres", "host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
        "login": stack["EOS_PG_USER"], "password": stack["EOS_PG_PASSWORD"], "schema": stack["EOS_PG_DB"],
        "extra": {"sslmode": "prefer", "sslpassword": SSL_KEY_PASSWORD}})
    name = f"guard{uuid.uuid4().hex[:8]}"
    config = pipeline_config(stack, tmp_path, name, spec=EVENTS_ONLY, max_offsets_per_trigger=400)
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=2)
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 600, topic=config["topics"][0], accounts=40, seed=22,
                   transactional_id=f"g{name}")
    config_file = tmp_path / f"{name}.json"
    config_file.write_text(json.dumps(config))
    store = tmp_path / "store"
    snapped = {"config": config, "config_file": config_file, "store": store, "tmp": tmp_path, "name": name}
    from airflow_provider_eos.hooks.pg_tools import PgToolsHook

    hook = PgToolsHook(postgres_conn_id=PG_KEYPW, pg_bin_dir=PG_BIN, meta_schema=config["meta_schema"])
    _create_tables(config, stack)  # what the app's start does before its first batch
    set_stop_request(hook, name, True)  # the direct replay writes only under a stop
    _replay(snapped)
    snapped["hook"] = hook
    snapped["snapshot"] = _snapshot(snapped, PG_KEYPW)
    try:
        yield snapped
    finally:
        admin = pg_connect(stack)
        with admin.cursor() as cur:
            cur.execute("SELECT nspname FROM pg_namespace WHERE nspname IN (%s, %s) OR starts_with(nspname, %s)",
                        (config["target_schema"], config["meta_schema"], f"{config['target_schema']}_old_"))
            for (schema,) in cur.fetchall():
                cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        admin.close()


def _create_tables(config: dict, stack: dict) -> None:
    app = from_dict(config).validate()
    app.postgres.password = stack["EOS_PG_PASSWORD"]
    conn = app_connect(app.postgres.dsn_kwargs(), describe=app.postgres.dbname)
    try:
        ensure_meta_tables(conn, app.meta_schema)
        spec = load_spec(app.spec)
        create_targets(conn, spec, app.target_schema, delivery_mode(app, spec))
        conn.commit()
    finally:
        conn.close()


def _replay(snapped: dict) -> dict:
    return ReplayOperator(task_id="replay", pipeline_config=str(snapped["config_file"]), engine="direct",
                          postgres_conn_id=PG_CONN, kafka_config_id=KAFKA_CONN).execute({"run_id": "guards"})


def _snapshot(snapped: dict, conn_id: str) -> dict:
    return SnapshotOperator(task_id="snap", pipeline_config=str(snapped["config_file"]),
                            snapshot_store=str(snapped["store"]), postgres_conn_id=conn_id, keep_last=5,
                            pg_bin_dir=PG_BIN).execute({"run_id": "guards"})


def test_restore_refuses_a_snapshot_without_a_new_target_and_the_override_rolls_back_exactly(
        pipeline, stack) -> None:
    """Test 7: the snapshot was taken before ``account_balances`` became a target."""
    config, hook = pipeline["config"], pipeline["hook"]
    target = config["target_schema"]
    # "tool" is no secret: it shows the watch saw the client tools run (their flag, not the conninfo).
    watch = CmdlineWatch({"password": stack["EOS_PG_PASSWORD"], "sslpassword": SSL_KEY_PASSWORD,
                          "tool": "--no-password"}, interval=0.02)
    watch.start()
    try:
        # The target gets a second table: the spec changes, the stream applies 300 more events to both.
        pipeline["config_file"].write_text(json.dumps({**config, "spec": WITH_BALANCES}))
        produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 300, topic=config["topics"][0], accounts=40, seed=23,
                       transactional_id=f"h{pipeline['name']}", first_seq=600)
        _replay(pipeline)
        found = target_state(hook, config)
        assert int(found[f"{target}.account_balances"].split(":")[0]) > 0  # "<rows>:<sum of row hashes>"

        with pytest.raises(Exception, match=rf"not in the snapshot: {target}\.account_balances \(they "
                                                    r"would keep their rows while the offsets go back"):
            _restore(pipeline, postgres_conn_id=PG_KEYPW, keep_old=True).execute({"run_id": "guards-refused"})
        assert target_state(hook, config) == found

        restored = _restore(pipeline, postgres_conn_id=PG_KEYPW, keep_old=True,
                            allow_table_changes=True).execute({"run_id": "guards-override"})
        assert restored["table_changes"] == {"not_in_snapshot": [[target, "account_balances"]], "not_in_spec": []}
        after_restore = target_state(hook, config)
        assert after_restore[f"{target}.account_balances"] == found[f"{target}.account_balances"]
        assert after_restore[f"{target}.ledger_events"] != found[f"{target}.ledger_events"]  # back to 600 events
        # The replay applies the 300 events again: to the restored events (exact) and, a second
        # time, to the balances the snapshot did not hold. Then the recovery fails (forced) and rolls back.
        _replay(pipeline)
        replayed = target_state(hook, config)
        assert replayed[f"{target}.ledger_events"] == found[f"{target}.ledger_events"]
        assert replayed[f"{target}.account_balances"] != found[f"{target}.account_balances"]
        done = RollbackRestoreOperator(task_id="rollback", pipeline_config=str(pipeline["config_file"]),
                                       postgres_conn_id=PG_KEYPW, aside_schema=restored["aside_schema"]).execute(
            {"run_id": "guards-override"})
        assert done["rolled_back"] and len(done["refilled"]) == 1, done
        assert done["refilled"][0].startswith(f"{target}.account_balances: ")
        assert target_state(hook, config) == found  # every table, its rows and the offsets: as the recovery found
        assert done["left_in_aside"] == []
    finally:
        watch.stop()
    seen = {label for label, _, _ in watch.hits}  # labels only: a failure must not print a secret
    assert seen == {"tool"}, seen


def test_a_world_writable_store_and_a_manifest_of_another_database_are_refused(pipeline, stack, tmp_path) -> None:
    """Test 8, and the identity a new manifest records."""
    config, hook = pipeline["config"], pipeline["hook"]
    store = pipeline["store"]
    manifest = SnapshotStore(str(store)).select(config["pipeline"], "latest")
    assert set(manifest.identity) == {"database", "database_oid", "system_identifier"}
    assert manifest.identity["database"] == stack["EOS_PG_DB"]
    found = target_state(hook, config)

    os.chmod(store, 0o777)
    try:
        with pytest.raises(Exception, match=rf"refusing snapshot store {store}: its mode 0777 lets its group and "
                                            rf"every user write to it\..*chmod go-w {store}"):
            _restore(pipeline).execute({"run_id": "guards-store"})
        with pytest.raises(Exception, match=rf"refusing snapshot store {store}"):
            _snapshot(pipeline, PG_CONN)
    finally:
        os.chmod(store, 0o700)
    assert target_state(hook, config) == found

    # The same pipeline (name, schemas, tables) in another database, snapshotted into the same store.
    other_db = f"eos_other_{uuid.uuid4().hex[:8]}"
    admin = pg_connect(stack)
    with admin.cursor() as cur:
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(other_db)))
    other_conn = "eos_guard_other_pg"
    os.environ[f"AIRFLOW_CONN_{other_conn.upper()}"] = json.dumps({
        "conn_type": "postgres", "host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
        "login": stack["EOS_PG_USER"], "password": stack["EOS_PG_PASSWORD"], "schema": other_db})
    try:
        _create_tables({**config, "postgres": {**config["postgres"], "dbname": other_db}}, stack)
        foreign = _snapshot(pipeline, other_conn)
        assert SnapshotStore(str(store)).select(config["pipeline"], "latest").snapshot_id == foreign["snapshot_id"]
        with pytest.raises(Exception, match=rf"snapshot {foreign['snapshot_id']} is of another database: its "
                                            rf"database '{other_db}' \(the target's is '{stack['EOS_PG_DB']}'\), "
                                            r"database_oid '\d+' \(the target's is '\d+'\)"):
            _restore(pipeline).execute({"run_id": "guards-foreign"})
        assert target_state(hook, config) == found
    finally:
        with admin.cursor() as cur:
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(other_db)))
        admin.close()


def test_every_session_has_tcp_keepalives(pipeline) -> None:
    """§4: the provider's sessions and the app's (the same connection factory as its driver,
    executors and audit) ask the server for keepalives, so their locks die with a vanished host."""
    sessions = {"provider": pipeline["hook"].connect()}
    app = from_dict(pipeline["config"]).validate()
    app.postgres.password = os.environ["EOS_PG_PASSWORD"]
    sessions["app"] = app_connect(app.postgres.dsn_kwargs(), describe="keepalive check")
    try:
        for where, conn in sessions.items():
            with conn.cursor() as cur:
                shown = {}
                for setting in ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count"):
                    cur.execute(sql.SQL("SHOW {}").format(sql.Identifier(setting)))
                    shown[setting] = (cur.fetchone() or ("",))[0]
            assert shown == {"tcp_keepalives_idle": "30", "tcp_keepalives_interval": "10",
                             "tcp_keepalives_count": "3"}, where
    finally:
        for conn in sessions.values():
            conn.close()


def test_a_fence_never_waits_forever_for_the_pipelines_lock(pipeline, stack) -> None:
    """§4: the bump waits a bounded time and names what holds the lock; a prepared batch
    left in doubt is committed once no driver is connected (the Spark case: test_two_phase)."""
    from airflow_provider_eos.operators.restore import FenceOperator
    from spark_apps.eos_stream.sink.in_doubt import gid_prefix
    from spark_apps.eos_stream.state import fencing

    config, name = pipeline["config"], pipeline["name"]
    fence = {"task_id": "fence", "pipeline_config": str(pipeline["config_file"]), "postgres_conn_id": PG_CONN,
             "wait_seconds": 2}
    # A session stuck in its batch transaction, holding the pipeline's lock.
    stuck = pg_connect(stack)
    stuck.autocommit = False
    with stuck.cursor() as cur:
        cur.execute("SET application_name = 'stuck-batch'")
        cur.execute("SELECT pg_backend_pid()")
        (pid,) = cur.fetchone()
        fencing.lock_pipeline(cur, name)
    try:
        with pytest.raises(Exception, match=rf"could not bump its epoch within 2s, its lock \(eos:{name}\) is held "
                                            rf"by: pid {pid} \(stuck-batch from 127\.0\.0\.1, idle in transaction"):
            FenceOperator(**fence).execute({"run_id": "fence-stuck"})
    finally:
        stuck.close()
    # A prepared batch: in doubt while its driver is still connected (it commits its own) ...
    gid = f"{gid_prefix(name)}{uuid.uuid4().hex[:24]}"
    driver, batch = pg_connect(stack), pg_connect(stack)
    try:
        _fence_with_an_orphan(fence, stack, config, name, gid, driver, batch)
    finally:
        admin = pg_connect(stack)  # never leave a prepared transaction behind on the shared server
        with admin.cursor() as cur:
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE gid = %s", (gid,))
            if cur.fetchone():
                cur.execute("ROLLBACK PREPARED %s", (gid,))
        admin.close()


def _fence_with_an_orphan(fence: dict, stack: dict, config: dict, name: str, gid: str, driver, batch) -> None:
    from airflow_provider_eos.operators.restore import FenceOperator
    from spark_apps.eos_stream.state import fencing
    from spark_apps.eos_stream.state.control import hold_running_lock

    try:
        hold_running_lock(driver, name, wait_seconds=5)
        batch.autocommit = False
        with batch.cursor() as cur:
            fencing.lock_pipeline(cur, name)
            cur.execute(sql.SQL("UPDATE {}.kafka_offsets SET batch_id = batch_id WHERE pipeline = %s").format(
                sql.Identifier(config["meta_schema"])), (name,))
            cur.execute("PREPARE TRANSACTION %s", (gid,))
        batch.close()
        with pytest.raises(Exception, match=rf"is held by: prepared transaction '{gid}' \(in doubt since "):
            FenceOperator(**fence).execute({"run_id": "fence-live-driver"})
    finally:
        driver.close()  # ... then the driver dies: its batch is an orphan, committed by the fence
    fenced = FenceOperator(**fence).execute({"run_id": "fence-orphan"})
    assert fenced["in_doubt_committed"] == [gid] and fenced["epoch"] > 0
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_prepared_xacts WHERE gid = %s", (gid,))
        assert cur.fetchone() == (0,)
    conn.close()
