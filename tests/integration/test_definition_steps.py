"""The pipeline steps given the definition (not an app config): each gets its complete config from
one call (``hooks/app_config.py``), and the replay runs through the spark-submit launcher. The
stop step's request holds the pipeline, as in a recovery, and only the replay writes through it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from psycopg2 import sql

from airflow_provider_eos.operators.replay import ReplayOperator
from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.utils.pipeline_definition import parse_definition
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.integration.test_restore_guards import _create_tables
from tests.integration.test_snapshot_restore import KAFKA_CONN, PG_CONN, connections_env
from tests.streaming import audit, definition_of, pg_connect, pipeline_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_steps_given_the_definition_stop_and_replay_on_spark(stack: dict, tmp_path: Path, unique_name: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {**connections_env(stack),
                       "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"})}.items():
        monkeypatch.setenv(key, value)
    config = pipeline_config(stack, tmp_path, f"defs{unique_name}")
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=2)
    produced = produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 300, topic=config["topics"][0], abort_every=5)
    definition = parse_definition(definition_of(config, connections={"kafka": KAFKA_CONN, "postgres": PG_CONN}),
                                  source="test")
    _create_tables(config, stack)  # what the stream's first start would have done
    try:
        stop = StopPipelineOperator(task_id="stop", definition=definition, postgres_conn_id=PG_CONN,
                                    wait=False).execute({"run_id": "defs"})
        assert stop["requested_at"] and stop["pipeline"] == config["pipeline"]
        replay = ReplayOperator(task_id="replay", definition=definition, engine="spark", postgres_conn_id=PG_CONN,
                                kafka_config_id=KAFKA_CONN,
                                checkpoint_dir=str(tmp_path / "replay-ck"), spark_conf={"spark.ui.enabled": "false"})
        replayed = replay.execute({"run_id": "defs"})
        assert replayed["engine"]["engine"] == "spark" and replayed["events_replayed"] > 0
        report = audit(config, tmp_path, {"EOS_PG_PASSWORD": stack["EOS_PG_PASSWORD"]})
        assert report["ok"] and report["summary"]["committed_records"] == produced.committed, report
    finally:
        admin = pg_connect(stack)
        with admin.cursor() as cur:
            for schema in (config["target_schema"], config["meta_schema"]):
                cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        admin.commit()
        admin.close()
