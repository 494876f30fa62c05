"""End to end: run the pipeline, snapshot it (its eos_snapshot__<name> DAG), process more,
damage the target, then its eos_recovery__<name> (dag.test) puts it back: the audit is
exact and the tables equal the undamaged reference.

Two kinds of damage: rows deleted, duplicated and balances corrupted by hand
(after a dry run that must change nothing); and the DB ahead of a lost
checkpoint, with the recovery's worker killed between restore and replay.
And a recovery of a live topic: a producer commits all along, and the target
is exact once the resumed stream has caught up."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from psycopg2 import sql

from demo.feed import Feed
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.conftest import ROOT, spark_submit_opts
from tests.helpers.airflow_tests_env import own_airflow_env
from tests.helpers.dag_test_process import EXIT_AFTER_RESULTS, end_process_group
from tests.streaming import (
    audit,
    ledger_order,
    pg_connect,
    pipeline_config,
    run_app,
    run_direct_replay,
    write_definition,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DAG_TEST = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
from datetime import datetime
out = []
for dag_id, conf, *logical_date in json.loads(sys.argv[2]):
    # The same logical date and run_after rerun that DAG run (same run id), like clearing it.
    when = {"logical_date": datetime.fromisoformat(logical_date[0]),
            "run_after": datetime.fromisoformat(logical_date[0])} if logical_date else {}
    run = bag.get_dag(dag_id).test(run_conf=conf, **when)
    tis = {ti.task_id: ti for ti in run.get_task_instances()}
    summary = tis["summary"].xcom_pull(task_ids="summary") if "summary" in tis else None
    out.append({"dag_id": dag_id, "run_id": run.run_id, "state": str(run.state),
                "tasks": {ti.task_id: str(ti.state) for ti in tis.values()}, "summary": summary})
print("RESULT " + json.dumps(out, default=str))
""" + EXIT_AFTER_RESULTS


def _airflow_env(stack: dict[str, str], config_dir: Path, store: Path) -> dict[str, str]:
    env = own_airflow_env()  # the tests' own deployment, not the demo's (tests/helpers/airflow_tests_env.py)
    env.update({
        "AIRFLOW__EOS__PIPELINE_CONFIG_DIR": str(config_dir),
        "AIRFLOW__EOS__SNAPSHOT_STORE": str(store),
        "AIRFLOW__EOS__PG_BIN_DIR": "/usr/lib/postgresql/15/bin",
        "AIRFLOW__EOS__SPARK_JARS": stack["EOS_SPARK_JARS"],
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}),
        "PYTHONPATH": str(ROOT),
        "SPARK_SUBMIT_OPTS": spark_submit_opts(),
    })
    return env


def _start_dag_test(env: dict[str, str], runs: list, tmp: Path) -> tuple[subprocess.Popen, Path]:
    log = tmp / f"dagtest-{len(list(tmp.glob('dagtest-*')))}.log"
    with open(log, "w") as handle:  # its own session: a SIGKILL of the group takes spark-submit along
        process = subprocess.Popen([sys.executable, "-c", DAG_TEST, str(ROOT / "dags"), json.dumps(runs)], env=env,
                                   cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return process, log


def _dag_test(env: dict[str, str], runs: list, tmp: Path) -> list[dict]:
    process, log = _start_dag_test(env, runs, tmp)
    try:
        process.wait(timeout=420)
    finally:
        end_process_group(process)  # what it left behind, or all of it on a timeout
    result = process
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, text[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def _forget_offsets(stack: dict, config: dict) -> None:
    """Deletes the pipeline's stored offsets, every delivery mode's replay point."""
    from spark_apps.eos_stream.state import meta_tables

    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("DELETE FROM {} WHERE pipeline = %s").format(
                meta_tables.table(config["meta_schema"], meta_tables.OFFSETS)), (config["pipeline"],))
        conn.commit()
    finally:
        conn.close()


def _state(stack: dict, config: dict) -> dict:
    conn = pg_connect(stack)
    t, m = sql.Identifier(config["target_schema"]), sql.Identifier(config["meta_schema"])
    out = {}
    with conn.cursor() as cur:
        cur.execute("SET TIME ZONE 'UTC'")
        for table in ("ledger_events", "account_balances"):
            cur.execute(sql.SQL("SELECT count(*), md5(string_agg(x::text, ',' ORDER BY x::text)) FROM {}.{} x")
                        .format(t, sql.Identifier(table)))
            out[table] = cur.fetchone()
        cur.execute(sql.SQL("SELECT topic, partition, next_offset FROM {}.kafka_offsets ORDER BY 1, 2").format(m))
        out["offsets"] = cur.fetchall()
        cur.execute(sql.SQL('SELECT topic, partition, "offset" FROM {}.dead_letters ORDER BY 1, 2, 3').format(m))
        out["dead_letters"] = cur.fetchall()
    conn.close()
    return json.loads(json.dumps(out, default=str))


# The pipelines of the tests that start from the same state: a name prefix and the definition's sections.
# Both replays are the default engine, auto: the default threshold takes direct for these ~2000 records,
# a threshold of 0 takes spark.
SNAPSHOTTED = {"replay_spark": ("recs", {"stream": {"replay_direct_max_records": 0}}),
               "replay_direct": ("recd", {}),
               # rollback breaks the replay's spark-submit: its replay must be spark, whatever the size.
               "crash": ("crash", {}), "rollback": ("rb", {"stream": {"replay_engine": "spark"}})}
# Whose setup runs are the Spark app's: the Spark-engine recovery's pipeline, Spark end to end. The
# others' setup only has to leave a pipeline's state in the database, which the Spark-less replay
# leaves alike (the same claim and sink) without a JVM: no snapshot or recovery reads a stream's
# checkpoint (the replay starts a fresh one from the database's offsets), and the crash test deletes
# it before its own Spark runs.
SPARK_SETUP = {"replay_spark"}


def _setup_run(config: dict, tmp: Path, label: str, spark: bool) -> None:
    """Processes what the topic holds, with the Spark app or the Spark-less replay."""
    if spark:
        run = run_app(config, tmp, label=label)
        assert run.process.returncode == 0, run.log()[-3000:]
    else:
        replay = run_direct_replay(config, tmp, label=label)
        assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]


@pytest.fixture(scope="module")
def snapshotted(stack: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, dict, dict]]:
    """For each of SNAPSHOTTED, a pipeline with 3000 events processed, an eos_snapshot, 2000 more
    processed: its config, its Airflow env and its undamaged reference state.

    The same steps each test used to take for itself, taken once for all four: the pipelines read
    one topic into their own schemas, checkpoints and definitions, and their snapshots run in one
    dag.test() process. Only SPARK_SETUP's runs are spark-submits (2 of 8), the others are the
    Spark-less replay. Each env names a definition directory holding only its own pipeline, so a
    test's DagBag parses one. Running one of these tests alone builds all four."""
    bootstrap = stack["EOS_KAFKA_BOOTSTRAP"]
    base, suffix = tmp_path_factory.mktemp("snapshotted"), uuid.uuid4().hex[:8]
    topic, store, all_dir = f"ledger.snap{suffix}", base / "store", base / "pipelines"
    configs = {}
    for key, (prefix, sections) in SNAPSHOTTED.items():
        (base / key).mkdir()
        config = pipeline_config(stack, base / key, f"{prefix}{suffix}", topics=[topic])
        write_definition(config, all_dir, **sections)
        write_definition(config, base / key / "pipelines", **sections)
        configs[key] = config
    ensure_topic(bootstrap, topic, partitions=4)

    produce_ledger(bootstrap, 3000, topic=topic, abort_every=4, malformed=1, seed=5, transactional_id=f"a{topic}")
    for key, config in configs.items():
        _setup_run(config, base / key, "first", key in SPARK_SETUP)
    snaps = _dag_test(_airflow_env(stack, all_dir, store),
                      [[f"eos_snapshot__{config['pipeline']}", {}] for config in configs.values()], base)
    assert [snap["state"] for snap in snaps] == ["success"] * len(configs), snaps

    produce_ledger(bootstrap, 2000, topic=topic, abort_every=3, malformed=2, seed=6, first_seq=10_000,
                   transactional_id=f"b{topic}")
    out = {}
    for key, config in configs.items():
        _setup_run(config, base / key, "second", key in SPARK_SETUP)
        reference = _state(stack, config)
        assert reference["ledger_events"][0] == 5000
        out[key] = (config, _airflow_env(stack, base / key / "pipelines", store), reference)
    return out


def _stop_requested(stack: dict, config: dict) -> bool:
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT stop_requested_at IS NOT NULL FROM {}.stream_control WHERE pipeline = %s")
                        .format(sql.Identifier(config["meta_schema"])), (config["pipeline"],))
            row = cur.fetchone()
        return bool(row and row[0])
    finally:
        conn.close()


def _aside_schemas(stack: dict, config: dict, with_tables: bool = False) -> list[str]:
    """A restore's aside schemas (``<target_schema>_old_<time>``), or only those still holding tables."""
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT nspname FROM pg_namespace n WHERE starts_with(nspname, %s) AND (NOT %s OR"
                        " EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = n.oid AND c.relkind = 'r'))"
                        " ORDER BY 1", (config["target_schema"][:40] + "_old_", with_tables))
            return [r[0] for r in cur.fetchall()]
    finally:
        conn.close()


def _triggered_stream_runs(env: dict[str, str], pipeline: str) -> list[dict]:
    """Confs of the runs of ``pipeline``'s stream DAG (a recovery's resume creates one); they are
    deleted (no scheduler runs in the tests, and none must find them later)."""
    import sqlalchemy

    dag = f"eos_stream__{pipeline}"
    engine = sqlalchemy.create_engine(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    try:
        with engine.begin() as conn:
            rows = conn.execute(sqlalchemy.text("SELECT conf FROM dag_run WHERE dag_id = :dag"), {"dag": dag})
            confs = [(json.loads(conf) if isinstance(conf, str) else conf) or {} for (conf,) in rows]
            conn.execute(sqlalchemy.text("DELETE FROM task_instance WHERE dag_id = :dag"), {"dag": dag})
            conn.execute(sqlalchemy.text("DELETE FROM dag_run WHERE dag_id = :dag"), {"dag": dag})
            return confs
    finally:
        engine.dispose()


def _assert_recovered(stack: dict, config: dict, tmp_path: Path, reference: dict) -> None:
    report = audit(config, tmp_path)
    assert report["ok"], report  # balances and each account's last_seq included
    assert report["summary"]["committed_records"] == 5003
    order = ledger_order(stack, config["target_schema"])
    assert order["out_of_order_accounts"] == 0 and order["split_accounts"] == 0, order
    after = _state(stack, config)
    assert after == reference, {k: (after[k], reference[k]) for k in after if after[k] != reference[k]}


@pytest.mark.parametrize("replay_engine", ["spark", "direct"])
def test_recovery_dag_restores_and_replays_exactly(stack, tmp_path, snapshotted, replay_engine) -> None:
    config, env, reference = snapshotted[f"replay_{replay_engine}"]
    name = config["pipeline"]

    conn = pg_connect(stack)
    with conn.cursor() as cur:  # damage: lost rows, duplicated rows, corrupted balances
        t = sql.Identifier(config["target_schema"])
        cur.execute(sql.SQL("DELETE FROM {}.ledger_events WHERE seq % 11 = 0").format(t))
        cur.execute(sql.SQL("INSERT INTO {0}.ledger_events SELECT * FROM {0}.ledger_events LIMIT 100").format(t))
        cur.execute(sql.SQL("UPDATE {}.account_balances SET balance_cents = balance_cents * 2").format(t))
    conn.close()
    damaged = _state(stack, config)
    assert not audit(config, tmp_path)["ok"]
    assert ledger_order(stack, config["target_schema"])["out_of_order_accounts"] > 0  # the duplicated rows

    conf = {"snapshot": "latest", "resume": False, "quiet_seconds": 1}
    recovery = f"eos_recovery__{name}"
    [dry] = _dag_test(env, [[recovery, {**conf, "dry_run": True}]], tmp_path)
    assert dry["state"] == "success", dry
    assert _state(stack, config) == damaged  # the dry run changed nothing
    # resume: the triggered stream run is only created (dag.test runs this DAG alone); its DAG is checked.
    [real] = _dag_test(env, [[recovery, {**conf, "dry_run": False, "resume": True}]], tmp_path)
    assert real["state"] == "success", real
    assert real["tasks"]["resume_stream"] == "success" and real["tasks"]["release_lock"] == "success"
    assert real["tasks"]["finalize"] == "success" and real["tasks"]["rollback"] == "skipped", real
    summary = real["summary"]  # rows restored, events replayed, seconds per step
    assert summary["rows_restored"] > 0 and summary["events_replayed"] > 0 and summary["audit"]["ok"], summary
    # auto chose by the offsets to replay (the 2000 committed records, aborted ones and markers) and said so.
    chosen = summary["replay_engine"]
    assert (chosen["asked"], chosen["engine"]) == ("auto", replay_engine), chosen
    assert chosen["records_to_replay"] >= 2000, chosen
    steps = summary["seconds_per_step"]
    assert set(steps) == {"lock", "stop_stream", "choose_snapshot", "retention_check", "restore", "replay",
                          "audit", "finalize"} and all(v is not None and v >= 0
                                                                        for v in steps.values()), steps
    _assert_recovered(stack, config, tmp_path, reference)
    # The replay ran past the stop request without clearing it: nothing could restart the stream meanwhile.
    assert _stop_requested(stack, config), "the recovery cleared the stop request"
    assert _aside_schemas(stack, config) == []  # finalize dropped the old tables
    # This pipeline's own stream DAG, with no conf: its definition gives the mode the stream had.
    # No conf but the OpenLineage provider's link to the run that resumed it (when the provider is installed).
    resumed = _triggered_stream_runs(env, name)
    assert [{k: v for k, v in conf.items() if k != "openlineage"} for conf in resumed] == [{}]
    lineage = resumed[0].get("openlineage")
    assert lineage is None or lineage["parentJobName"] == f"eos_recovery__{name}.resume_stream"


def _task_state(env: dict[str, str], dag_id: str, logical_date: str, task_id: str) -> str | None:
    """A task's state in Airflow's metadata database, read directly. By run id: ``dag.test`` names a run
    after its logical date, while SQLite stores the date in a format a bound string never equals."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    try:
        with engine.connect() as conn:
            return conn.execute(sqlalchemy.text(
                "SELECT state FROM task_instance WHERE dag_id = :dag AND task_id = :task AND run_id = :run"),
                {"dag": dag_id, "task": task_id, "run": f"manual__{logical_date}"}).scalar()
    finally:
        engine.dispose()


def test_recovery_finishes_after_its_worker_is_killed_between_restore_and_replay(
        stack, tmp_path, snapshotted) -> None:
    config, env, reference = snapshotted["crash"]
    name = config["pipeline"]

    # A lost checkpoint is harmless to exactly_once: every run starts from the DB's offsets.
    shutil.rmtree(config["checkpoint_dir"], ignore_errors=True)
    assert run_app(config, tmp_path, label="lost-checkpoint-eos").process.returncode == 0
    assert _state(stack, config) == reference
    # Damage: the pipeline's stored offsets lost (a hand-made DELETE) and the same pipeline
    # redeployed in at_least_once, which resumes from them and has no other guard: it starts
    # over from the earliest offsets, so every event lands twice.
    _forget_offsets(stack, config)
    assert run_app({**config, "delivery": "at_least_once"}, tmp_path, label="lost-checkpoint-alo"
                   ).process.returncode == 0
    damaged = _state(stack, config)
    assert damaged["ledger_events"][0] == 10_000
    report = audit(config, tmp_path)
    assert not report["ok"] and report["summary"]["duplicated"] == 5000, report["summary"]

    conf = {"snapshot": "latest", "resume": False, "quiet_seconds": 1, "dry_run": False}
    recovery = f"eos_recovery__{name}"
    first_run = "2026-01-02T03:04:05+00:00"
    # The worker dies with the restore done and the replay just begun, before the replay's first
    # batch commits: the replay (the direct engine, in the worker's process) SIGKILLs the
    # dag.test process group at its fault point. (Polling the replay task's state for "running"
    # could see it only after the replay of these 2000 records had committed, or ended.)
    faulty = {**env, "EOS_FAULT_POINT": "before_commit", "EOS_FAULT_AT_BATCH": "1"}
    process, log = _start_dag_test(faulty, [[recovery, conf, first_run]], tmp_path)
    try:
        process.wait(timeout=300)
    finally:
        end_process_group(process)
    killed_in = {task: _task_state(env, recovery, first_run, task) for task in ("restore", "replay")}
    assert process.returncode == -signal.SIGKILL and killed_in == {"restore": "success", "replay": "running"}, (
        process.returncode, killed_in, log.read_text(errors="replace")[-4000:])
    restored = _state(stack, config)
    assert restored["ledger_events"][0] == 3000  # the snapshot's rows, not yet replayed
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT holder FROM {}.recovery_locks").format(sql.Identifier(config["meta_schema"])))
        [(dead_holder,)] = cur.fetchall()  # the killed run never reached its teardown
    conn.close()

    # A new recovery is refused while the dead run's lock is fresh, and touches nothing.
    [refused] = _dag_test(env, [[recovery, conf]], tmp_path)
    assert refused["state"] == "failed" and refused["tasks"]["lock"] == "failed", refused
    assert refused["tasks"]["restore"] == "upstream_failed"
    assert _state(stack, config) == restored

    # Rerunning the killed run re-enters its lock; every step redoes or detects its work.
    [rerun] = _dag_test(env, [[recovery, conf, first_run]], tmp_path)
    assert rerun["run_id"] == dead_holder and rerun["state"] == "success", rerun
    assert rerun["tasks"]["release_lock"] == "success"
    _assert_recovered(stack, config, tmp_path, reference)


def test_failed_replay_rolls_back_to_the_state_before_the_recovery(stack, tmp_path, snapshotted) -> None:
    config, env, reference = snapshotted["rollback"]
    name = config["pipeline"]
    conn = pg_connect(stack)
    with conn.cursor() as cur:  # the state the recovery finds: rows lost and balances off
        t = sql.Identifier(config["target_schema"])
        cur.execute(sql.SQL("DELETE FROM {}.ledger_events WHERE seq % 7 = 0").format(t))
        cur.execute(sql.SQL("UPDATE {}.account_balances SET balance_cents = balance_cents + 1").format(t))
    conn.close()
    before = _state(stack, config)
    assert before != reference

    # The replay's spark-submit cannot load the Kafka connector ([eos] spark_jars names a missing jar):
    # it fails after the swap committed.
    broken = {**env, "AIRFLOW__EOS__SPARK_JARS": str(tmp_path / "no-such-connector.jar")}
    conf = {"snapshot": "latest", "resume": True, "quiet_seconds": 1, "dry_run": False}
    [run] = _dag_test(broken, [[f"eos_recovery__{name}", conf]], tmp_path)
    tasks = run["tasks"]
    assert run["state"] == "failed" and tasks["restore"] == "success" and tasks["replay"] == "failed", run
    assert tasks["rollback"] == "success" and tasks["finalize"] == "upstream_failed", run
    assert tasks["resume_stream"] != "success" and tasks["release_lock"] == "success", run
    # Exactly the state the recovery found: rows, balances, offsets, dead letters.
    after = _state(stack, config)
    assert after == before, {k: (after[k], before[k]) for k in after if after[k] != before[k]}
    assert _stop_requested(stack, config)  # the pipeline stays stopped for a human to decide
    assert _aside_schemas(stack, config, with_tables=True) == []  # the old tables went back, none left aside
    assert _triggered_stream_runs(env, name) == []


def test_recovery_succeeds_while_a_producer_keeps_committing(stack, tmp_path, unique_name) -> None:
    """Issue 22 §2: a live topic is the normal case. Records committed after the replay started
    are the resumed stream's next work, not "missing" in the recovery's audit."""
    name = f"live{unique_name}"
    bootstrap = stack["EOS_KAFKA_BOOTSTRAP"]
    config = pipeline_config(stack, tmp_path, name)
    topic = config["topics"][0]
    config_dir, store = tmp_path / "pipelines", tmp_path / "store"
    write_definition(config, config_dir, stream={"replay_engine": "direct"})
    env = _airflow_env(stack, config_dir, store)
    ensure_topic(bootstrap, topic, partitions=4)
    first = produce_ledger(bootstrap, 2000, topic=topic, abort_every=4, malformed=1, seed=5,
                           transactional_id=f"a{name}")
    _setup_run(config, tmp_path, "first", spark=False)  # the state to snapshot, as in snapshotted
    [snap] = _dag_test(env, [[f"eos_snapshot__{name}", {}]], tmp_path)
    assert snap["state"] == "success", snap

    # Small transactions on every partition, back to back from before the gate to after the audit,
    # so that some always land between the replay's goal and the audit's look at Kafka (at a tick
    # every 0.5 s, a loaded machine once let a replay and its audit fall between two commits).
    feed = Feed(lambda tick: produce_ledger(bootstrap, 60, topic=topic, batch_size=20, abort_every=3,
                                            seed=100 + tick, first_seq=100_000 * tick,
                                            transactional_id=f"feed{name}"), interval=0.05, name="ledger feed")
    feed.start()
    try:
        conf = {"snapshot": "latest", "resume": False, "quiet_seconds": 1, "dry_run": False}
        [run] = _dag_test(env, [[f"eos_recovery__{name}", conf]], tmp_path)
        during = len(feed.summaries)
    finally:
        produced = feed.stop()
    assert during >= 10, f"the feed committed only {during} times during the recovery"
    assert run["state"] == "success", run
    assert run["tasks"]["audit"] == "success" and run["tasks"]["rollback"] == "skipped", run
    audited = run["summary"]["audit"]["summary"]
    assert audited["missing"] == 0 and audited["not_yet_applied"] > 0, audited  # the feed's records above the goal

    # The resumed stream (here one availableNow run past the recovery's stop request) catches up.
    assert run_app({**config, "ignore_stop_request": True}, tmp_path, label="resumed").process.returncode == 0
    report = audit(config, tmp_path)
    assert report["ok"], report
    assert report["summary"]["committed_records"] == first.committed + first.malformed + sum(
        p.committed for p in produced), report["summary"]
