"""two_phase delivery against the real stack: a batch left in doubt by a killed
driver is found by its transaction id and committed once on restart; a
PostgreSQL with prepared transactions disabled is refused before Spark starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from psycopg2 import sql

from airflow_provider_eos.state.stop_requests import set_stop_request
from spark_apps.eos_stream.engines import spark as app
from spark_apps.eos_stream.sink.in_doubt import gid_prefix
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.conftest import ROOT
from tests.streaming import audit, pg_connect, pipeline_config, run_app

pytestmark = pytest.mark.integration


def _prepared(stack: dict, pipeline: str) -> list[str]:
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s)", (gid_prefix(pipeline),))
        gids = [row[0] for row in cur.fetchall()]
    conn.close()
    return gids


def _rows(stack: dict, config: dict) -> tuple[int, dict]:
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT count(*) FROM {}.ledger_events").format(sql.Identifier(config["target_schema"])))
        (rows,) = cur.fetchone()
        cur.execute(sql.SQL("SELECT partition, next_offset FROM {}.kafka_offsets WHERE pipeline = %s").format(
            sql.Identifier(config["meta_schema"])), (config["pipeline"],))
        offsets = dict(cur.fetchall())
    conn.close()
    return rows, offsets


def _left_in_doubt(stack: dict, tmp_path: Path, name: str, at_batch: int) -> tuple[dict, str]:
    """3000 events (4 partitions, aborted transactions, 2 malformed) and a
    two_phase driver killed between PREPARE TRANSACTION and COMMIT PREPARED of
    its ``at_batch``-th batch. Returns the config and the in-doubt gid."""
    config = pipeline_config(stack, tmp_path, name, delivery="two_phase", max_offsets_per_trigger=800)
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=4)
    produce_ledger(bootstrap, 3000, topic=topic, abort_every=4, malformed=2, seed=at_batch,
                   transactional_id=f"p{name}")
    crashed = run_app(config, tmp_path, label="in-doubt",
                      env_extra={"EOS_FAULT_POINT": "before_commit", "EOS_FAULT_AT_BATCH": str(at_batch)})
    assert crashed.process.returncode == -9 or "EOS-FAULT" in crashed.log(), crashed.log()[-3000:]
    [gid] = _prepared(stack, config["pipeline"])  # in doubt: durable, invisible, holding its locks
    return config, gid


def test_in_doubt_batch_of_a_killed_driver_is_committed_once(stack: dict, tmp_path: Path, unique_name: str) -> None:
    config, gid = _left_in_doubt(stack, tmp_path, f"tpc{unique_name}", at_batch=2)
    topic = config["topics"][0]
    rows_before, offsets_before = _rows(stack, config)
    assert 0 < rows_before <= 800  # only the first batch is visible

    resumed = run_app(config, tmp_path, label="resolve")
    assert resumed.process.returncode == 0, resumed.log()[-3000:]
    [resume] = resumed.events("resume")
    assert resume["in_doubt_committed"] == [gid]
    assert _prepared(stack, config["pipeline"]) == []
    report = audit(config, tmp_path)
    assert report["ok"], report
    assert report["summary"]["duplicated"] == 0 and report["summary"]["missing"] == 0
    assert report["summary"]["committed_records"] == 3002  # with the 2 malformed, dead-lettered
    # The stream resumed after the in-doubt batch: the first stored offsets it
    # started from already included it.
    assert sum(json.loads(resume["stored_offsets"])[topic].values()) > sum(offsets_before.values())


def test_stop_stream_commits_a_batch_left_in_doubt_within_its_bound(
        stack: dict, tmp_path: Path, unique_name: str) -> None:
    """Issue 22 test 5: the recovery's stop_stream (stop request, fence, wait) behind a two_phase
    batch a killed driver left in doubt. It holds the pipeline's lock, which the fence's epoch
    bump needs: before, the step waited forever. Now the orphan is committed (it passed its
    ownership check) and the step returns at once; the recovery's replay ends exact."""
    import threading
    import time

    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
    from airflow_provider_eos.operators.replay import ReplayOperator
    from airflow_provider_eos.operators.stop import StopPipelineOperator
    from spark_apps.eos_stream.sink.in_doubt import resolve_in_doubt
    from tests.integration.test_snapshot_restore import KAFKA_CONN, PG_CONN, connections_env

    os.environ.update(connections_env(stack))
    config, gid = _left_in_doubt(stack, tmp_path, f"tps{unique_name}", at_batch=2)
    config_file = tmp_path / "pipeline.json"
    config_file.write_text(json.dumps(config))
    stop = StopPipelineOperator(task_id="stop_stream", pipeline_config=str(config_file), postgres_conn_id=PG_CONN,
                                fence=True, deferrable=False, timeout_seconds=20, poll_interval=0.5,
                                fence_wait_seconds=10)
    outcome: dict = {}
    worker = threading.Thread(target=lambda: outcome.update(stop.execute({"run_id": "stop-in-doubt"})), daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(45)
    waited = time.monotonic() - started
    if worker.is_alive():  # the old behaviour: release it, so the thread and the shared server recover
        conn = EosPostgresHook(postgres_conn_id=PG_CONN).connect()
        resolve_in_doubt(conn, config["pipeline"], "rollback")
        conn.close()
        worker.join(30)
    print(f"\nstop_stream returned after {waited:.1f}s: {outcome}")
    assert outcome.get("stopped") and waited < 20, f"stop_stream still waiting after {waited:.0f}s"
    assert outcome["in_doubt_committed"] == [gid] and _prepared(stack, config["pipeline"]) == []

    # The recovery goes on (its replay, the direct engine here: no second spark-submit) from the
    # offsets the committed batch stored: nothing twice, nothing lost.
    replayed = ReplayOperator(task_id="replay", pipeline_config=str(config_file), engine="direct",
                              postgres_conn_id=PG_CONN, kafka_config_id=KAFKA_CONN).execute({"run_id": "stop-in-doubt"})
    assert replayed["events_replayed"] > 0 and _prepared(stack, config["pipeline"]) == []
    report = audit(config, tmp_path)
    assert report["ok"], report
    assert report["summary"]["committed_records"] == 3002 and report["summary"]["duplicated"] == 0


def test_restore_rolls_back_the_in_doubt_batch_and_replay_is_exact(
        stack: dict, tmp_path: Path, unique_name: str) -> None:
    """The in-doubt recovery for a commit left in doubt: restore the snapshot
    (which rolls the orphan back, since it belongs to the state being replaced)
    and replay Kafka from the snapshot's offsets."""
    from airflow_provider_eos.hooks.pg_tools import PgToolsHook
    from airflow_provider_eos.operators.restore import RestoreOperator
    from airflow_provider_eos.operators.snapshot import SnapshotOperator
    from tests.integration.test_snapshot_restore import KAFKA_CONN, PG_BIN, PG_CONN, connections_env

    os.environ.update(connections_env(stack))
    config, gid = _left_in_doubt(stack, tmp_path, f"tpr{unique_name}", at_batch=3)
    config_file = tmp_path / "pipeline.json"
    config_file.write_text(json.dumps(config))
    common = {"pipeline_config": str(config_file), "postgres_conn_id": PG_CONN, "pg_bin_dir": PG_BIN,
              "snapshot_store": str(tmp_path / "store")}
    snap = SnapshotOperator(task_id="snap", **common).execute({"run_id": "t"})  # sees the 2 committed batches
    hook = PgToolsHook(postgres_conn_id=PG_CONN, meta_schema=config["meta_schema"])
    set_stop_request(hook, config["pipeline"], True)
    restored = RestoreOperator(task_id="restore", quiet_seconds=0, release_lock=True, kafka_config_id=KAFKA_CONN,
                               **common).execute({"run_id": "restore-in-doubt"})
    assert restored["snapshot_id"] == snap["snapshot_id"] and restored["in_doubt_rolled_back"] == [gid]
    assert _prepared(stack, config["pipeline"]) == []

    # The recovery keeps the stop request for its whole duration; only its own
    # replay run may write meanwhile.
    held = run_app(config, tmp_path, label="restarted-under-recovery")
    assert held.process.returncode == 0 and held.events("batch") == [], held.log()[-3000:]
    replay = run_app({**config, "ignore_stop_request": True}, tmp_path, label="replay")
    assert replay.process.returncode == 0, replay.log()[-3000:]
    assert replay.events("resume")[0]["in_doubt_committed"] == []
    set_stop_request(hook, config["pipeline"], False)
    report = audit(config, tmp_path)
    assert report["ok"], report
    assert report["summary"]["committed_records"] == 3002 and report["summary"]["duplicated"] == 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _second_postgres(stack: dict, tmp_path: Path, max_prepared: int):
    """A second PostgreSQL cluster (Debian's binaries, scripts/stack.sh) of this test alone,
    with ``max_prepared_transactions`` = ``max_prepared``; removed afterwards."""
    env = {**os.environ, "EOS_STATE_DIR": str(tmp_path / f"pg{max_prepared}"), "EOS_PG_PORT": str(_free_port()),
           "EOS_PG_MAX_PREPARED": str(max_prepared), "EOS_PG_PASSWORD": stack["EOS_PG_PASSWORD"]}
    script = str(ROOT / "scripts" / "stack.sh")
    subprocess.run([script, "start-postgres"], env=env, check=True, timeout=120, capture_output=True)
    try:
        yield {**stack, "EOS_PG_PORT": env["EOS_PG_PORT"]}
    finally:
        subprocess.run([script, "reset"], env=env, timeout=120, capture_output=True)


@pytest.fixture
def postgres_without_2pc(stack: dict, tmp_path: Path):
    """A second cluster with max_prepared_transactions = 0, PostgreSQL's default."""
    yield from _second_postgres(stack, tmp_path, 0)


@pytest.fixture
def postgres_with_one_slot(stack: dict, tmp_path: Path):
    """A second cluster with max_prepared_transactions = 1."""
    yield from _second_postgres(stack, tmp_path, 1)


def test_no_free_prepared_transaction_slot_names_the_setting(postgres_with_one_slot: dict) -> None:
    """Issue 22 §4: what PostgreSQL really answers at PREPARE TRANSACTION (psycopg2's
    tpc_prepare, as the sink calls it) with every slot taken, and the message
    ``in_doubt.prepare_failure`` makes of it."""
    import psycopg2

    from spark_apps.eos_stream.sink.in_doubt import PreparedTransactionsExhausted, prepare_failure
    from tests.sink_harness import LedgerSink

    stack = postgres_with_one_slot
    first, second = pg_connect(stack), pg_connect(stack)
    try:
        first.autocommit = second.autocommit = False
        first.tpc_begin("eos:slots:first")
        first.tpc_prepare()  # takes the only slot, as an orphan would
        second.tpc_begin("eos:slots:second")
        with pytest.raises(psycopg2.Error) as raised:
            second.tpc_prepare()
        error = prepare_failure(raised.value, gid="eos:slots:second")
        print(f"\nPostgreSQL: {raised.value.pgcode} {str(raised.value).strip()}\nbecomes: {error}")
        assert raised.value.pgcode == "53200" and error is not None
        assert "max_prepared_transactions" in str(error) and "SQLSTATE 53200" in str(error)
        # Through the sink: the clear error at once, not 300 s of retrying a "transient" 53200.
        with LedgerSink(stack, "slots", delivery="two_phase") as sink:
            started = time.monotonic()
            with pytest.raises(PreparedTransactionsExhausted, match="max_prepared_transactions"):
                sink.process()
            assert time.monotonic() - started < 10
            assert sink.events_and_count() == ((0, 0), None)
        first.tpc_rollback()
    finally:
        first.close()
        second.close()


def test_two_phase_refuses_postgres_without_prepared_transactions(
    postgres_without_2pc: dict, tmp_path: Path, unique_name: str, capsys: pytest.CaptureFixture
) -> None:
    stack = postgres_without_2pc
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], f"ledger.nopc{unique_name}", partitions=1)
    config = pipeline_config(stack, tmp_path, f"nopc{unique_name}", delivery="two_phase")
    path = tmp_path / "two_phase.json"
    path.write_text(json.dumps(config))
    assert app.main(["--config", str(path)]) == app.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "max_prepared_transactions is 0" in err and f":{stack['EOS_PG_PORT']}/" in err, err
    conn = pg_connect(stack)
    with conn.cursor() as cur:  # refused before anything was written or prepared
        cur.execute("SELECT current_setting('max_prepared_transactions'), count(*) FROM pg_prepared_xacts")
        assert cur.fetchone() == ("0", 0)
        cur.execute("SELECT to_regclass(%s)", (f'"{config["target_schema"]}".ledger_events',))
        assert cur.fetchone() == (None,)
    conn.close()
