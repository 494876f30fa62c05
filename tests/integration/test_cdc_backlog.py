"""A backlog of real change records applied in many batches, on both engines.

Debezium's PostgreSQL connector publishes the five tables of ``tests/helpers/cdc_workload.py``
(primary-key changes, a TOASTed text left unchanged by updates, deletes, composite keys, the
types the mirror maps) while no stream runs, for ``BACKLOG_SECONDS``; a column the definition
does not list is added to one table on the way. Then the same mirror definition applies the whole
backlog in batches of at most ``BATCH`` records (the default change path), on Spark and on the
continuous engine, each into a target schema of its own. Each must end with every table equal to
its source, both ways (rows the target lacks and rows it has that the source does not), each
aggregate equal to its GROUP BY, no dead letter, and the new column added by the stream.

The change topics are checked to hold what the test is about (deletes, updates, unchanged TOAST
values), and each engine to have needed several batches: a backlog read in one batch would not
test how batches meet.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from psycopg2 import sql

from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook
from bench.harness import kafka_connect_connection
from tests.helpers.cdc_oracle import change_counts, compare, high_watermarks, stored_offsets, topics_written
from tests.helpers.cdc_source import drop_source_schema, wait_until
from tests.helpers.cdc_workload import (
    KEYS,
    SOURCE_DDL,
    NewColumn,
    Workload,
    holds_marks,
    mirror_connector,
    mirror_definition,
)
from tests.helpers.continuous import request_stop
from tests.streaming import AppRun, dead_letter_count, pg_connect, pipeline_config, start_app, start_continuous

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
CONNECT_CONN = "eos_cdc_backlog_connect"
BACKLOG_SECONDS = 12
BATCH = 250


@dataclass
class Backlog:
    """The source schema, its connector's topics and the workload that wrote them."""

    env: dict[str, str]
    schema: str
    workload: Workload
    marks: dict[str, tuple[str, tuple]]
    definition: Path

    @property
    def topics(self) -> list[str]:
        return [f"{self.schema}.{self.schema}.{table}" for table in KEYS]


@pytest.fixture
def backlog(connect: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backlog]:
    env, unique = connect, uuid.uuid4().hex[:10]
    schema, slot, connector = f"cdcb_{unique}", f"dbz_{unique}", f"backlog-{unique}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONNECT_CONN.upper()}", kafka_connect_connection(env))
    hook, workload = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN), Workload(env, schema)
    try:
        with workload.conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        workload._write(list(SOURCE_DDL))
        hook.put_connector_config(connector, mirror_connector(env, schema, slot))
        wait_until(f"{connector} RUNNING", lambda: not hook.connector_problems(connector))
        workload.run(BACKLOG_SECONDS, threading.Event(),
                     NewColumn("customers", "loyalty", "numeric(12,3)",
                               lambda r: f"{r.randint(0, 10**6)}.{r.randint(0, 999):03d}"), BACKLOG_SECONDS / 2)
        assert workload.error is None, workload.error
        definition = tmp_path / "mirror.yaml"
        definition.write_text(json.dumps(mirror_definition(schema), indent=2))  # JSON is YAML
        state = Backlog(env, schema, workload, workload.marker(), definition)
        wait_until("the change topics", lambda: topics_written(env["EOS_KAFKA_BOOTSTRAP"], state.topics))
        yield state
    finally:
        hook.delete_connector(connector)
        workload.close()
        drop_source_schema(env, slot, schema)


def _apply_backlog(backlog: Backlog, tmp_path: Path, engine: str) -> tuple[AppRun, dict[str, Any]]:
    """The mirror on ``engine`` until its target holds the backlog's last transaction and its
    stored offsets are the topics' ends, then stopped by a stop request (exit 0)."""
    config = pipeline_config(backlog.env, tmp_path, f"backlog_{engine}_{uuid.uuid4().hex[:8]}", topics=backlog.topics,
                             spec=f"mirror:{backlog.definition}", trigger="processingTime",
                             trigger_interval="1 second", max_offsets_per_trigger=BATCH)
    run = (start_app if engine == "spark" else start_continuous)(config, tmp_path, label=engine)
    target = pg_connect(backlog.env)
    try:
        def caught_up() -> bool:
            assert run.process.poll() is None, run.log()[-3000:]
            ends = high_watermarks(backlog.env["EOS_KAFKA_BOOTSTRAP"], backlog.topics)
            held = holds_marks(target, config["target_schema"], backlog.marks)
            return held and stored_offsets(target, config) == ends

        wait_until(f"{engine}: the backlog applied", caught_up, timeout=400, interval=1)
        request_stop(backlog.env, config)
        assert run.wait(180) == 0, run.log()[-3000:]
    finally:
        run.kill()
        target.close()
    return run, config


@pytest.mark.parametrize("engine", ["spark", "continuous"])
def test_a_backlog_is_applied_exactly_in_many_batches(backlog: Backlog, tmp_path: Path, engine: str) -> None:
    run, config = _apply_backlog(backlog, tmp_path, engine)
    batches = [e for e in run.events("batch") if e["applied"] or e["dead_lettered"]]
    target = pg_connect(backlog.env)
    try:
        oracle = compare(backlog.workload.conn, backlog.schema, target, config["target_schema"])
        dead = dead_letter_count(target, config)
    finally:
        target.close()
    customers = backlog.topics[0]
    ops = change_counts(backlog.env["EOS_KAFKA_BOOTSTRAP"], customers,
                        high_watermarks(backlog.env["EOS_KAFKA_BOOTSTRAP"], [customers])[customers])
    print(f"\n{engine}: {len(batches)} batches; oracle (source rows, rows that differ) {oracle}; "
          f"{customers}: {ops}; workload {backlog.workload.stats}")
    assert ops["unchanged TOAST"] > 0 and ops["d"] > 0 and ops["u"] > 0, ops  # the backlog holds what is tested
    assert len(batches) >= 4, batches
    assert all(count > 0 and differ == 0 for count, differ in oracle.values()), oracle
    assert dead == 0
    added = [e for e in run.events("mirror_columns_added") if e["table"] == "customers" and "loyalty" in e["columns"]]
    assert added, "the stream never added the new column"
