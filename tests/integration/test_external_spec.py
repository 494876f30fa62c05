"""A team's own spec, from a package outside this repository, on the Spark standalone cluster.

The package lives in a directory of its own (a team's repository) that the test's Airflow side
can import (``PYTHONPATH``, as a DAGs folder or an installed distribution would give) and the
cluster's worker cannot: the worker was started without it. The submit hook ships the spec's
package in the ``--py-files`` zip beside ``spark_apps``; the same run with only ``spark_apps``
in the zip must fail on the executors, so the test shows what the shipping does."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from confluent_kafka import Producer

from airflow_provider_eos.hooks.stream_submit import EosStreamSubmitHook, build_spark_apps_zip
from spark_apps.ledger.generator import ensure_topic
from tests.helpers.cmdline import CmdlineWatch
from tests.helpers.kafka import wait_for_markers
from tests.integration.test_stream_operator import airflow_conns  # noqa: F401 (fixture)
from tests.streaming import audit, pipeline_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

SPEC_MODULE = '''
from psycopg2 import sql

from spark_apps.eos_stream.records.spec import AggregateTarget, Field, PipelineSpec, RowTarget

from {package}.naming import TOTALS


def ddl(schema, unique_coordinates=False):
    s = sql.Identifier(schema)
    return [sql.SQL("CREATE SCHEMA IF NOT EXISTS {{}}").format(s),
            sql.SQL("CREATE TABLE IF NOT EXISTS {{}}.items (kafka_topic text, kafka_partition int,"
                    " kafka_offset bigint, item text, n bigint)").format(s),
            sql.SQL("CREATE TABLE IF NOT EXISTS {{}}.{{}} (item text PRIMARY KEY, total bigint NOT NULL)"
                    ).format(s, sql.Identifier(TOTALS))]


ITEMS = PipelineSpec(
    name="items",
    fields=(Field("item", "text"), Field("n", "bigint")),
    targets=(RowTarget("items", columns=("item", "n")),
             AggregateTarget(TOTALS, group_by=("item",), increments={{"total": "n"}})),
    target_ddl=ddl,
)
'''


@pytest.fixture
def team_repo(tmp_path: Path, unique_name: str, monkeypatch) -> str:
    """A package of the team's own, importable here only through PYTHONPATH."""
    package = f"acme_{unique_name}"
    root = tmp_path / "team-repo"
    (root / package / "specs").mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    (root / package / "naming.py").write_text('TOTALS = "item_totals"\n')  # a sibling the spec imports
    (root / package / "specs" / "__init__.py").write_text("")
    (root / package / "specs" / "items.py").write_text(textwrap.dedent(SPEC_MODULE.format(package=package)))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    return f"{package}.specs.items:ITEMS"


def _produce(bootstrap: str, topic: str, events: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for i in range(events):
        producer.produce(topic, key=f"i{i % 37}", value=json.dumps({"item": f"i{i % 37}", "n": i}))
    producer.flush(30)
    wait_for_markers(bootstrap, topic)


def _run(config: dict, spark_conn: str, conf: dict | None = None, **hook_kwargs) -> tuple[int, str]:
    hook = EosStreamSubmitHook(conn_id=spark_conn, postgres_password=os.environ["EOS_TEST_PG_PASSWORD"],
                               conf={"spark.cores.max": "1", "spark.executor.cores": "1",
                                     "spark.executor.memory": "512m", "spark.sql.shuffle.partitions": "2",
                                     **(conf or {})},
                               **hook_kwargs)
    try:
        result = hook.run_app(config)
    finally:
        hook.cleanup()
    events = [e for e in result.events if e[0] == "error"]
    return result.returncode, json.dumps(events) + result.log_tail


def test_a_spec_from_the_teams_own_package_runs_on_the_cluster(
        airflow_conns, spark_cluster: str, team_repo: str, tmp_path: Path, unique_name: str,  # noqa: F811
        monkeypatch) -> None:
    stack = airflow_conns
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_CLUSTER", spark_cluster)
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    monkeypatch.setenv("EOS_TEST_PG_PASSWORD", stack["EOS_PG_PASSWORD"])
    # driver_write_max_records 0: the executors write every batch, so they must import the spec (by
    # default the driver, which has the team's package on its path, would write batches this small).
    config = pipeline_config(stack, tmp_path, f"ext{unique_name}", spec=team_repo, driver_write_max_records=0)
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=2)
    _produce(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], 2000)

    # Without the team's package in the zip, the executors cannot import the spec.
    bare = build_spark_apps_zip(tmp_path)
    code, log = _run({**config, "pipeline": f"{config['pipeline']}x", "meta_schema": f"{config['meta_schema']}x",
                      "target_schema": f"{config['target_schema']}x"}, "spark_cluster", py_files=bare,
                     conf={"spark.task.maxFailures": "1"})  # the first failed task says it all
    assert code != 0 and "No module named" in log, log

    watch = CmdlineWatch({"database password": stack["EOS_PG_PASSWORD"]},
                         executor_marker=stack["EOS_SPARK_WORKER_URL"])
    watch.start()
    try:
        code, log = _run(config, "spark_cluster")
    finally:
        watch.stop()
    assert code == 0, log
    assert watch.executors, "no executor was launched by the worker: the app did not run on the cluster"
    assert not watch.hits, watch.hits
    report = audit(config, tmp_path, env_extra={"EOS_PG_PASSWORD": stack["EOS_PG_PASSWORD"]})
    assert report["ok"], report
    assert report["summary"]["committed_records"] == 2000, report["summary"]
