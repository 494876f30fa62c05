"""Secured Kafka (SASL_PLAINTEXT + SCRAM-SHA-512 on the local broker's second listener),
spelled once in librdkafka's names, as a Kafka connection's extra holds them.

The app takes them from ``EOS_KAFKA_OPTIONS_JSON`` (never its command line), uses them as they
are for its own librdkafka clients (preflight, audit) and translated for Spark's Java source
(``spark_apps.eos_stream.kafka.security``). Every process's command line is read all along."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from psycopg2 import sql

from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.helpers.cmdline import CmdlineWatch
from tests.streaming import audit, pg_connect, pipeline_config, run_app, write_definition

pytestmark = pytest.mark.integration


def sasl_options(stack: dict[str, str], password: str | None = None) -> dict[str, str]:
    return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": stack["EOS_KAFKA_SASL_USER"],
            "sasl.password": password or Path(stack["EOS_KAFKA_SASL_PASSWORD_FILE"]).read_text().strip()}


def test_a_wrong_password_is_a_clear_configuration_error(stack: dict, tmp_path: Path, unique_name: str) -> None:
    config = pipeline_config(stack, tmp_path, f"saslbad{unique_name}",
                             kafka_bootstrap=stack["EOS_KAFKA_SASL_BOOTSTRAP"])
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=1)
    env = {"EOS_KAFKA_OPTIONS_JSON": json.dumps(sasl_options(stack, password="not-the-password"))}
    run = run_app(config, tmp_path, env_extra=env, timeout=180)
    assert run.process.returncode == 2, run.log()[-3000:]
    assert "refused the credentials" in run.log() and "Kafka connection" in run.log()
    assert "not-the-password" not in run.log()


# ---------------------------------------------------------------- a pipeline from its definition
SASL_CONN = "kafka_sasl"


def _sasl_connection(stack: dict[str, str], password: str | None = None) -> str:
    return json.dumps({"conn_type": "kafka", "extra": {"bootstrap.servers": stack["EOS_KAFKA_SASL_BOOTSTRAP"],
                                                       "group.id": "eos", **sasl_options(stack, password)}})


def test_a_pipeline_runs_and_recovers_through_sasl_from_its_definition(stack: dict, tmp_path: Path,
                                                                       unique_name: str, monkeypatch) -> None:
    """Stream, health check, the hanging-transaction search (the abort's client), snapshot, damage,
    recovery with replay and audit, all through the SASL listener with the credentials only in the
    connection; no process's command line shows the Kafka or the database password, and no output
    shows the Kafka password.

    The app gets the credentials from the operator as ``EOS_KAFKA_OPTIONS_JSON``, so its stream and
    replay runs here are also the test of the app streaming exactly once through SASL (that test ran
    the app once more on a topic of its own, with the same assertions)."""
    from airflow_provider_eos.hooks.kafka_transactions import KafkaTransactionsHook
    from tests.integration.test_recovery_dag import _airflow_env, _dag_test

    name = f"saslp{unique_name}"
    config = pipeline_config(stack, tmp_path, name, trigger="availableNow")
    topic, plain = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    config_dir, store = tmp_path / "pipelines", tmp_path / "store"
    write_definition(config, config_dir, connections={"kafka": SASL_CONN})
    env = {**_airflow_env(stack, config_dir, store), f"AIRFLOW_CONN_{SASL_CONN.upper()}": _sasl_connection(stack)}
    ensure_topic(plain, topic, partitions=2)
    produce_ledger(plain, 2000, topic=topic, abort_every=4, seed=7, transactional_id=f"a{name}")

    options = sasl_options(stack)
    watch = CmdlineWatch({"kafka password": options["sasl.password"], "database password": stack["EOS_PG_PASSWORD"]})
    watch.start()
    try:
        runs = _dag_test(env, [[f"eos_stream__{name}", {}], [f"eos_health__{name}", {}],
                               [f"eos_snapshot__{name}", {}]], tmp_path)
        assert [r["state"] for r in runs] == ["success"] * 3, runs
        monkeypatch.setenv(f"AIRFLOW_CONN_{SASL_CONN.upper()}", env[f"AIRFLOW_CONN_{SASL_CONN.upper()}"])
        assert KafkaTransactionsHook(kafka_config_id=SASL_CONN).find_hanging(topic=topic) == []

        produce_ledger(plain, 1000, topic=topic, seed=8, first_seq=10_000, transactional_id=f"b{name}")
        conn = pg_connect(stack)
        with conn.cursor() as cur:  # damage: lost rows and a corrupted balance
            cur.execute(sql.SQL("DELETE FROM {}.ledger_events WHERE seq % 7 = 0").format(
                sql.Identifier(config["target_schema"])))
        conn.close()
        [recovered] = _dag_test(env, [[f"eos_recovery__{name}", {"snapshot": "latest", "resume": False,
                                                                  "quiet_seconds": 1}]], tmp_path)
        assert recovered["state"] == "success", recovered
        assert recovered["summary"]["events_replayed"] >= 1000 and recovered["summary"]["audit"]["ok"], recovered
        report = audit({**config, "kafka_bootstrap": stack["EOS_KAFKA_SASL_BOOTSTRAP"]}, tmp_path,
                       env_extra={"EOS_KAFKA_OPTIONS_JSON": json.dumps(options)})
    finally:
        watch.stop()
    assert report["ok"] and report["summary"]["committed_records"] == 3000, report["summary"]
    assert watch.seen > 0 and not watch.hits, watch.hits
    logs = sorted(tmp_path.glob("dagtest-*.log"))
    assert len(logs) == 2 and "EOS-BATCH" in logs[0].read_text(errors="replace"), logs
    # The job that warms the Python workers reads Kafka with the tasks' settings, SASL's too.
    assert "EOS-WORKERS_WARMED" in logs[0].read_text(errors="replace")
    assert not [log.name for log in logs if "EOS-WORKERS_NOT_WARMED" in log.read_text(errors="replace")]
    assert not [log.name for log in logs if options["sasl.password"] in log.read_text(errors="replace")]


def test_a_wrong_password_fails_the_stream_naming_the_connection(stack: dict, tmp_path: Path,
                                                               unique_name: str) -> None:
    from tests.helpers.dag_test_process import end_process_group
    from tests.integration.test_recovery_dag import _airflow_env, _start_dag_test

    name = f"saslw{unique_name}"
    config = pipeline_config(stack, tmp_path, name, trigger="availableNow")
    config_dir = tmp_path / "pipelines"
    write_definition(config, config_dir, connections={"kafka": SASL_CONN}, stream={"max_restarts": 0})
    env = {**_airflow_env(stack, config_dir, tmp_path / "store"),
           f"AIRFLOW_CONN_{SASL_CONN.upper()}": _sasl_connection(stack, password="not-the-password")}
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=1)
    process, log = _start_dag_test(env, [[f"eos_stream__{name}", {}]], tmp_path)
    try:
        process.wait(timeout=300)
    finally:
        end_process_group(process)
    text = log.read_text(errors="replace")
    assert "refused the credentials" in text and f"kafka {SASL_CONN!r}" in text, text[-4000:]
    assert "not-the-password" not in text


def test_a_hanging_transaction_is_described_and_aborted_through_sasl(stack: dict, unique_name: str,
                                                                    monkeypatch) -> None:
    """The abort's Python admin client (kafka-python) with the connection's SCRAM credentials:
    describe the partition's producers, then abort the transaction a SIGKILLed producer left open."""
    from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
    from airflow_provider_eos.operators.hanging_transactions import HangingTransactionsOperator
    from tests.helpers.kafka import create_topic, delete_topics, open_transaction

    plain, topic = stack["EOS_KAFKA_BOOTSTRAP"], f"eos_sasl_abort_{unique_name}"
    create_topic(plain, topic, partitions=1)
    monkeypatch.setenv(f"AIRFLOW_CONN_{SASL_CONN.upper()}", _sasl_connection(stack))
    try:
        with open_transaction(plain, topic, partition=0, count=3, txn_timeout_ms=600_000):
            pass  # the producer is SIGKILLed on leaving: its transaction stays open
        described = HangingTransactionsOperator(task_id="describe", action="describe-producers",
                                                kafka_config_id=SASL_CONN, topic=topic, partition=0).execute({})
        [start] = [r["CurrentTransactionStartOffset"] for r in described["rows"]
                   if r["CurrentTransactionStartOffset"] is not None]
        done = HangingTransactionsOperator(task_id="abort", action="abort", kafka_config_id=SASL_CONN, topic=topic,
                                           partition=0, start_offset=start, confirm_abort=True).execute({})
        assert done["aborted"] == [{"topic": topic, "partition": 0, "start_offset": start}]
        after = KafkaOffsetsHook(kafka_config_id=SASL_CONN).partition_offsets([topic])[(topic, 0)]
        assert after.lag == 0 and after.last_stable == after.high_watermark == 4  # 3 records + the abort marker
    finally:
        delete_topics(plain, topic)
