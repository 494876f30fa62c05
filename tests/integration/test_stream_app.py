"""The streaming app against the real stack: upstream transactions, poison
records, a lost checkpoint, replays, and configuration errors."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from psycopg2 import sql

from spark_apps.eos_stream.engines import spark as app
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.streaming import audit, pg_connect, pipeline_config, run_app, start_app

pytestmark = pytest.mark.integration

OPEN_TXN_CHILD = """
import sys, time
from confluent_kafka import Producer
p = Producer({"bootstrap.servers": sys.argv[1], "transactional.id": sys.argv[3],
              "transaction.timeout.ms": 120000})
p.init_transactions(30)
p.begin_transaction()
for i in range(50):
    p.produce(sys.argv[2], key=b"acct-00001", value=b'{"event_id": "open", "account_id": "acct-00001",'
              b' "amount_cents": 1000000, "ts": "2026-01-01T00:00:00+00:00", "seq": -5}')
p.flush(30)
print("OPEN", flush=True)
sys.stdin.readline()  # the test says when the transaction ends
p.abort_transaction(30)
print("ABORTED", flush=True)
"""


def _count(stack: dict, schema: str, table: str) -> int:
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT count(*) FROM {}.{}").format(sql.Identifier(schema), sql.Identifier(table)))
        (count,) = cur.fetchone()
    conn.close()
    return count


def test_open_transaction_stalls_the_stream_until_it_ends(stack: dict, tmp_path: Path, unique_name: str) -> None:
    config = pipeline_config(stack, tmp_path, f"txn{unique_name}")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=1)  # one partition: the open transaction blocks what follows it
    produce_ledger(bootstrap, 1000, topic=topic, abort_every=2, batch_size=250, seed=1,
                   transactional_id=f"a{unique_name}")
    child = subprocess.Popen([sys.executable, "-c", OPEN_TXN_CHILD, bootstrap, topic, f"o{unique_name}"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "OPEN"
        produce_ledger(bootstrap, 500, topic=topic, seed=2, first_seq=10_000, transactional_id=f"b{unique_name}")
        first = run_app(config, tmp_path, label="stalled")
        assert first.process.returncode == 0, first.log()[-3000:]
        # Only what precedes the open transaction is below the LSO.
        assert _count(stack, config["target_schema"], "ledger_events") == 1000
        assert child.stdin is not None
        child.stdin.write("end\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ABORTED"
    finally:
        child.kill()
        child.wait()
    second = run_app(config, tmp_path, label="resumed")
    assert second.process.returncode == 0, second.log()[-3000:]
    assert _count(stack, config["target_schema"], "ledger_events") == 1500
    report = audit(config, tmp_path)
    assert report["ok"], report
    assert report["summary"]["committed_records"] == 1500
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT count(*) FROM {}.ledger_events WHERE event_id = 'open'").format(
            sql.Identifier(config["target_schema"])))
        assert cur.fetchone() == (0,)  # the aborted transaction never reached the DB
    conn.close()


def test_lost_checkpoint_causes_no_duplicates(stack: dict, tmp_path: Path, unique_name: str) -> None:
    config = pipeline_config(stack, tmp_path, f"ckpt{unique_name}", max_offsets_per_trigger=1000)
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=2)
    produce_ledger(bootstrap, 8000, topic=topic, seed=4)
    # Mid-run for certain: its fault point kills the driver before its fourth batch commits, if
    # the test has not killed it by then (a driver writing small batches may get through them
    # all between two looks at its log), so it never reaches the topic's end.
    run = start_app(config, tmp_path, label="ckpt-first",
                    env_extra={"EOS_FAULT_POINT": "before_commit", "EOS_FAULT_AT_BATCH": "4"})
    deadline = time.monotonic() + 120
    while len(run.events("batch")) < 2 and time.monotonic() < deadline and run.process.poll() is None:
        time.sleep(0.1)
    # Mid-run: the driver may be writing its next batch's checkpoint files meanwhile (with
    # apply-ahead, a batch is reported while Spark runs the next one), so this first removal
    # tolerates what it races with, and the second, with the driver dead, leaves nothing.
    shutil.rmtree(config["checkpoint_dir"], ignore_errors=True)
    run.kill()
    assert run.process.returncode == -9 and len(run.events("batch")) >= 2, run.log()[-3000:]
    shutil.rmtree(config["checkpoint_dir"], ignore_errors=True)
    assert not Path(config["checkpoint_dir"]).exists()
    assert 0 < _count(stack, config["target_schema"], "ledger_events") <= 3000  # at most 3 batches of 1000 offsets
    final = run_app(config, tmp_path, label="ckpt-final")
    assert final.process.returncode == 0, final.log()[-3000:]
    report = audit(config, tmp_path)
    assert report["ok"] and report["summary"]["duplicated"] == 0, report


def test_a_replayed_batch_applies_nothing_twice(stack: dict, tmp_path: Path, unique_name: str) -> None:
    """Records below the stored offsets are skipped record by record, whatever
    Spark's checkpoint believes: re-staging every applied row as a new batch
    applies nothing, while the same statement without the guard applies all."""
    from spark_apps.eos_stream.sink import apply_sql
    from spark_apps.ledger.spec import LEDGER

    config = pipeline_config(stack, tmp_path, f"replay{unique_name}")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=2)
    produce_ledger(bootstrap, 2000, topic=topic, seed=5)
    assert run_app(config, tmp_path, label="replay-1").process.returncode == 0
    schema = sql.Identifier(config["target_schema"])
    restage = sql.SQL("{}.restage").format(schema)

    def statement(guarded: bool) -> sql.Composed:
        return apply_sql.apply_batch_statement(
            LEDGER, stage=restage, target_schema=config["target_schema"], meta_schema=config["meta_schema"],
            skip_applied=guarded, dedupe=guarded, upsert_rows=False)

    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL(
            "CREATE TABLE {s}.restage AS SELECT kafka_topic AS _topic, kafka_partition AS _partition,"
            " kafka_offset AS _offset, NULL::bytea AS _key, NULL::bytea AS _value, NULL::text AS _error,"
            " event_id, account_id::text, amount_cents, ts, seq FROM {s}.ledger_events").format(s=schema))
        cur.execute(statement(guarded=True), {"pipeline": config["pipeline"]})
        assert cur.fetchone() == (0, 0)
        cur.execute("BEGIN")
        cur.execute(statement(guarded=False), {"pipeline": config["pipeline"]})
        assert cur.fetchone()[0] == 2000  # without the guard every row would apply again
        cur.execute("ROLLBACK")
    conn.close()
    assert audit(config, tmp_path)["ok"]


def test_a_partition_staged_twice_applies_once(stack: dict, unique_name: str) -> None:
    """A staging task retried after its COPY committed leaves more rows in the
    stage than the successful tasks reported: the writer counts, sees it and
    dedupes. Only a matching count lets it skip the dedupe's sort, which the
    second half shows by claiming the doubled count."""
    from spark_apps.eos_stream.records.parsing import staging_columns, staging_lines
    from spark_apps.eos_stream.records.spec import StageCount
    from spark_apps.eos_stream.run import preflight
    from spark_apps.eos_stream.sink.modes import MODES
    from spark_apps.eos_stream.sink.offsets_store import OffsetsStore
    from spark_apps.eos_stream.sink.staging import copy_from_chunks, create_stage
    from spark_apps.eos_stream.sink.writer import BatchWriter
    from spark_apps.ledger.generator import _event
    from spark_apps.ledger.spec import LEDGER

    pipeline, target, meta = f"twice{unique_name}", f"t_twice{unique_name}", f"m_twice{unique_name}"
    conn = pg_connect(stack)
    conn.autocommit = False
    mode = MODES["exactly_once"]
    preflight.ensure_meta_tables(conn, meta)
    preflight.create_targets(conn, LEDGER, target, mode)
    stage = create_stage(conn, LEDGER, meta, "stage_twice")
    rng = __import__("random").Random(3)
    start = __import__("datetime").datetime(2026, 1, 1)
    records = [("t", 0, offset, None, _event(rng, offset, 5, start)[1]) for offset in range(10)]
    lines = "".join(staging_lines(LEDGER, records, keep_raw=False)).encode()
    with conn.cursor() as cur:
        for _ in range(2):  # the first attempt's COPY committed, then the retry's
            copy_from_chunks(cur, stage, staging_columns(LEDGER), iter([lines]))
    conn.commit()
    writer = BatchWriter(conn, LEDGER, mode, OffsetsStore(meta, pipeline), target, meta)
    try:
        for reported, applied in [(10, 10), (20, 20)]:
            prepared = writer.prepare(stage, 0, {}, {("t", 0): 10}, record_by_record=False,
                                      staged=StageCount(reported))
            assert prepared.applied == applied, (reported, prepared.applied)
            conn.rollback()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("overrides", "exit_code", "message"),
    [
        ({"delivery": "sometimes"}, 2, "unknown delivery mode 'sometimes'"),
        ({"delivery": "idempotent"}, 2, "cannot protect aggregate targets"),
        ({"create_targets": False, "target_schema": "nowhere"}, 2, "target table nowhere.ledger_events does not exist"),
        ({"kafka_bootstrap": "127.0.0.1:1"}, 1, "cannot reach Kafka at 127.0.0.1:1"),
        ({"postgres": {"host": "127.0.0.1", "port": 1, "dbname": "eos", "user": "eos"}}, 1,
         "cannot connect to PostgreSQL eos@127.0.0.1:1/eos"),
        ({"topics": ["no.such.topic"]}, 2, "Kafka topic 'no.such.topic' does not exist"),
    ],
)
def test_bad_configuration_gets_a_clear_error(
    stack: dict, tmp_path: Path, unique_name: str, capsys: pytest.CaptureFixture, overrides: dict,
    exit_code: int, message: str,
) -> None:
    config = pipeline_config(stack, tmp_path, f"bad{unique_name}")
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=1)
    config.update(overrides)
    path = tmp_path / "bad.json"
    path.write_text(__import__("json").dumps(config))
    assert app.main(["--config", str(path)]) == exit_code
    assert message in capsys.readouterr().err


def test_sql_injection_in_a_table_name_stays_a_name(stack: dict, tmp_path: Path, unique_name: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE TABLE {} (x int)").format(sql.Identifier("public", f"canary_{unique_name}")))
    config = pipeline_config(stack, tmp_path, f"inj{unique_name}", create_targets=False,
                             target_schema=f'public"; DROP TABLE canary_{unique_name}; --')
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=1)
    path = tmp_path / "inj.json"
    path.write_text(__import__("json").dumps(config))
    assert app.main(["--config", str(path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    with conn.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (f"public.canary_{unique_name}",))
        assert cur.fetchone()[0] is not None  # still there
        cur.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier("public", f"canary_{unique_name}")))
    conn.close()


def test_the_connections_libpq_options_reach_the_app(stack: dict, tmp_path: Path, unique_name: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    """``postgres.options`` (from the Airflow connection's extras) is what the app connects
    with: sslmode=require against the stack's non-TLS server is refused, so the option
    arrived; sslmode=disable with target_session_attrs=read-write streams normally."""
    config = pipeline_config(stack, tmp_path, f"opt{unique_name}")
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=1)
    path = tmp_path / "opt.json"
    config["postgres"]["options"] = {"sslmode": "require"}
    path.write_text(__import__("json").dumps(config))
    assert app.main(["--config", str(path)]) == 1
    assert "server does not support SSL" in capsys.readouterr().err
    config["postgres"]["options"] = {"sslmode": "disable", "target_session_attrs": "read-write"}
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 300, topic=config["topics"][0], seed=5,
                   transactional_id=f"opt{unique_name}")
    run = run_app(config, tmp_path, label="options")
    assert run.process.returncode == 0, run.log()[-3000:]
    assert audit(config, tmp_path)["ok"]
