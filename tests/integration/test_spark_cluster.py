"""Two pipelines on a real Spark standalone cluster (scripts/stack.sh start-spark), one recovered
while the other keeps streaming, and no secret on any process's command line.

Both streams run under StreamingPipelineOperator with the Spark connection pointing at the
master, so their executors are launched by the worker (client deploy mode: each driver is its
spark-submit). Pipeline A is snapshotted, damaged and recovered by its own ``eos_recovery__<A>``
DAG (``dag.test()``: restore, replay on the cluster, audit); pipeline B streams all the while.
Both audits end exact. A thread reads ``/proc/<pid>/cmdline`` of every process on the machine
during the whole test: neither the database password nor a Kafka client secret may appear."""

from __future__ import annotations

import json
import secrets
import sys
from typing import Any

import pytest
from psycopg2 import sql

from airflow_provider_eos.sensors.stream_progress import StreamCaughtUpSensor
from tests.helpers.cmdline import CmdlineWatch
from tests.integration.test_recovery_dag import _airflow_env, _dag_test
from tests.integration.test_stream_operator import Watcher, airflow_conns, make_pipeline  # noqa: F401 (fixtures)
from tests.streaming import pg_connect, write_definition

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

CLUSTER_CONN = "spark_cluster"
# Each stream takes one core and a small executor, so two fit on the 2-core worker with room left.
EXECUTOR_CONF = {"spark.cores.max": "1", "spark.executor.cores": "1", "spark.executor.memory": "512m",
                 "spark.sql.shuffle.partitions": "2"}


def _damage(stack: dict, schema: str) -> None:
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        t = sql.Identifier(schema)
        cur.execute(sql.SQL("DELETE FROM {}.ledger_events WHERE seq % 5 = 0").format(t))
        cur.execute(sql.SQL("UPDATE {}.account_balances SET balance_cents = balance_cents + 7").format(t))
    conn.commit()
    conn.close()


def _caught_up(p: Any, conn_id: str = "kafka_default") -> dict[str, Any]:
    return StreamCaughtUpSensor(task_id=f"caught_up_{p.name}", pipeline=p.name, topics=[p.topic],
                                meta_schema=p.config["meta_schema"], kafka_config_id=conn_id, deferrable=False,
                                poke_interval=1, timeout=240).execute({})


def test_two_pipelines_on_a_spark_cluster_one_recovered_while_the_other_streams(
        spark_cluster, make_pipeline, monkeypatch, tmp_path) -> None:  # noqa: F811 (fixture)
    host_port = spark_cluster.removeprefix("spark://")
    host, port = host_port.rsplit(":", 1)
    cluster = json.dumps({"conn_type": "spark", "host": f"spark://{host}", "port": int(port)})
    monkeypatch.setenv(f"AIRFLOW_CONN_{CLUSTER_CONN.upper()}", cluster)
    # The executors' Python (it needs psycopg2 and pyarrow): deployment configuration, as the local
    # stack's airflow.env sets it for the Airflow components.
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    kafka_secret = "eos-test-" + secrets.token_hex(12)
    a, b = make_pipeline("clua"), make_pipeline("club")
    watch = CmdlineWatch({"database password": a.stack["EOS_PG_PASSWORD"], "kafka secret": kafka_secret},
                         executor_marker=a.stack["EOS_SPARK_WORKER_URL"])
    watch.start()
    streams = {}
    try:
        a.produce(3000, seed=1, abort_every=5, transactional_id=f"a1{a.name}")
        b.produce(3000, seed=2, abort_every=5, transactional_id=f"b1{b.name}")
        for p in (a, b):
            # driver_write_max_records 0: the executors write every batch, so the data path runs on the
            # cluster (by default the driver would write batches this small itself).
            streams[p.name] = Watcher(p.operator(
                trigger="processingTime", trigger_interval="2 seconds", max_offsets_per_trigger=1500,
                driver_write_max_records=0,
                spark_conn_id=CLUSTER_CONN, spark_conf=EXECUTOR_CONF, max_restarts=0,
                kafka_options={"sasl.password": kafka_secret}))
            streams[p.name].start()
        for p in (a, b):
            streams[p.name].live_hook(event="batch", timeout=240)
            _caught_up(p)
        assert watch.executors, "no executor was launched by the worker: the streams did not run on the cluster"

        # A's recovery, by its own DAG, on the cluster, while B keeps streaming.
        config_dir, store = tmp_path / "pipelines", tmp_path / "store"
        # spark, not the default auto: so small a replay would run direct, in this process, off the cluster.
        write_definition(a.config, config_dir, connections={"spark": CLUSTER_CONN}, stream={"replay_engine": "spark"})
        env = _airflow_env(a.stack, config_dir, store)
        env[f"AIRFLOW_CONN_{CLUSTER_CONN.upper()}"] = cluster
        [snap] = _dag_test(env, [[f"eos_snapshot__{a.name}", {}]], tmp_path)
        assert snap["state"] == "success", snap
        a.produce(1500, seed=3, first_seq=10_000, transactional_id=f"a2{a.name}")
        _caught_up(a)
        _damage(a.stack, a.config["target_schema"])
        assert not a.audit()["ok"]
        b_batches_before = len(streams[b.name].live_hook(event="batch", timeout=60).events)
        b.produce(1500, seed=4, first_seq=10_000, transactional_id=f"b2{b.name}")
        [recovery] = _dag_test(env, [[f"eos_recovery__{a.name}", {"resume": False, "quiet_seconds": 1}]], tmp_path)
        assert recovery["state"] == "success", recovery
        assert recovery["summary"]["events_replayed"] > 0 and recovery["summary"]["audit"]["ok"], recovery["summary"]

        # A's stream was stopped by its recovery (and stays stopped: resume=false); B never stopped.
        streams[a.name].join(60)
        assert not streams[a.name].is_alive() and streams[a.name].error is None
        assert streams[a.name].result["status"] == "stopped", streams[a.name].result
        assert streams[b.name].is_alive(), streams[b.name].error
        _caught_up(b)
        assert len(streams[b.name].live_hook(event="batch", timeout=60).events) > b_batches_before  # B kept committing
        for p in (a, b):
            report = p.audit()
            print(f"\n{p.name}: {report['summary']}")
            assert report["ok"] and report["summary"]["duplicated"] == 0 and report["summary"]["missing"] == 0
    finally:
        for p in (a, b):
            if p.name in streams and streams[p.name].is_alive():
                streams[p.name].op.on_kill()
                streams[p.name].join(60)
        watch.stop()
    print(f"command lines read: {watch.seen}, executors seen: {sorted(watch.executors)}")
    assert watch.seen > 1000
    assert watch.hits == [], watch.hits
