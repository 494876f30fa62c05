"""Debezium's JDBC sink connector, the mirror's peer a user would pick instead
(``bench/cdc_throughput.py --figures peer_jdbc``).

It runs for real, in the stack's Kafka Connect worker (started by
``bench.common.connect_stack``; its jars come with ``scripts/install.sh``), created through the
provider's ``KafkaConnectHook``, and reads the benchmark's change topics into its own schema of
the target database, with the settings its documentation gives for speed:

* ``insert.mode=upsert``, ``delete.enabled=true``, ``primary.key.mode=record_key``;
* ``batch.size`` with ``consumer.override.max.poll.records`` of the same size (the batch is
  capped by what one poll returns), and ``use.reduction.buffer`` (one write per key and batch);
* ``reWriteBatchedInserts=true`` on the JDBC URL; ``stringtype=unspecified`` lets PostgreSQL
  type the connector's strings (``numeric`` as text, ``timestamptz``, ``jsonb``) by the column;
* one task per partition of the topics, reading ``read_committed``.

Its tables are created first, as the mirror's are, so both targets have the same types. The
connector is at-least-once: it is timed from its creation (launch) and from the last poll that
found none of its rows (batches) until its target equals the change stream's final state,
polled every 0.25 s (a cheap signature first, the full comparison when it matches). A failed
task stops the bench with its trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from psycopg2 import sql

from bench.cdc_changes import COLUMNS, ChangeStream
from bench.common import CONNECT_CONN, drop_schemas
from bench.harness import pg_connect
from spark_apps.eos_stream.cdc import mirror_sql
from spark_apps.eos_stream.cdc.mirror import MirrorTarget

POLL_SECONDS = 0.25
BATCH = 10_000  # records per batch.size and per consumer poll, unless --jdbc-batch says otherwise
# A change topic is <prefix>.<schema>.<table>; the connector's table is <table>.
TABLE_OF_TOPIC = r"[^.]+\.[^.]+\.(.+)"


def connector_config(stack: dict[str, str], stream: ChangeStream, schema: str, tasks: int,
                     batch: int = BATCH) -> dict[str, Any]:
    """The JDBC sink's config: ``stream``'s change topics into ``schema``'s tables, ``batch``
    records per write and per consumer poll."""
    url = (f"jdbc:postgresql://{stack['EOS_PG_HOST']}:{stack['EOS_PG_PORT']}/{stack['EOS_PG_DB']}"
           "?reWriteBatchedInserts=true&stringtype=unspecified")
    return {
        "connector.class": "io.debezium.connector.jdbc.JdbcSinkConnector",
        "tasks.max": tasks,
        "topics": ",".join(stream.topics()),
        "connection.url": url,
        "connection.username": stack["EOS_PG_USER"],
        # Resolved inside the worker by its FileConfigProvider: never in the stored config or a log.
        "connection.password": f"${{file:{stack['EOS_CONNECT_TARGET_SECRETS']}:password}}",
        "insert.mode": "upsert",
        "delete.enabled": "true",
        "primary.key.mode": "record_key",
        "schema.evolution": "none",
        "batch.size": batch,
        "use.reduction.buffer": "true",
        "consumer.override.max.poll.records": batch,
        "consumer.override.isolation.level": "read_committed",
        "consumer.override.auto.offset.reset": "earliest",
        "transforms": "table",
        "transforms.table.type": "org.apache.kafka.connect.transforms.RegexRouter",
        "transforms.table.regex": TABLE_OF_TOPIC,
        "transforms.table.replacement": "$1",
        # Qualified: the connector looks an unqualified name up in every schema (not by the
        # search path) and writes to the first table of that name it finds.
        "collection.name.format": f"{schema}.${{topic}}",
    }


def _failed_task(hook: Any, name: str) -> str | None:
    """A failed task's trace, or None while every task runs (or has not started yet: a task not
    yet assigned is no failure, which ``connector_problems`` would count)."""
    from airflow_provider_eos.hooks.kafka_connect import ConnectorNotFoundError

    try:
        status = hook.get_connector_status(name)
    except ConnectorNotFoundError:
        return None
    for task in status.get("tasks", []):
        if task.get("state") == "FAILED":
            return str(task.get("trace", ""))[:3000]
    return None


def _signatures(stack: dict[str, str], schema: str, tables: list[str]) -> dict[str, tuple[int, int, int]]:
    """Per table: its row count, and the sums of its keys and of ``qty``."""
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            found = {}
            for table in tables:
                cur.execute(sql.SQL("SELECT count(*), coalesce(sum(id), 0), coalesce(sum(qty), 0) FROM {}.{}")
                            .format(sql.Identifier(schema), sql.Identifier(table)))
                count, keys, qty = cur.fetchone()
                found[table] = (int(count), int(keys), int(qty))
        return found
    finally:
        conn.close()


def expected_signatures(expected: dict[str, dict[int, tuple]]) -> dict[str, tuple[int, int, int]]:
    qty = list(COLUMNS).index("qty")
    return {table: (len(rows), sum(rows), sum(int(row[qty]) for row in rows.values()))
            for table, rows in expected.items()}


def create_tables(stack: dict[str, str], stream: ChangeStream, schema: str) -> None:
    """``schema`` anew, with a table per table of ``stream``, typed as the mirror types them."""
    conn = pg_connect(stack)
    drop_schemas(conn, schema)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        for table in stream.tables:
            cur.execute(mirror_sql.target_ddl(MirrorTarget(f"public.{table.name}", table.name, ("id",), COLUMNS),
                                              schema))
    conn.close()


def run_jdbc_peer(stack: dict[str, str], stream: ChangeStream, expected: dict[str, dict[int, tuple]], label: str,
                  partitions: int, differences: Callable[[str], dict[str, int]], batch: int = BATCH,
                  timeout: float = 1800) -> dict[str, Any]:
    """One timed run of the JDBC sink into schema ``t_<label>``; ``differences(schema)`` counts,
    per table, the rows where the target and the final state differ."""
    if not stream.schemas:
        raise SystemExit("peer_jdbc needs --schemas: the JDBC sink reads the records' Connect schemas")
    schema, name = f"t_{label}", f"bench-jdbc-{label}"
    create_tables(stack, stream, schema)
    wanted = expected_signatures(expected)
    # Airflow's import is kept out of the module: the tests import bench.cdc_throughput.
    from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook

    hook = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)
    # The batches clock starts at the last poll that found no row: rows came after it.
    launched, empty_at, first_row, done = time.time(), time.time(), None, None
    hook.put_connector_config(name, connector_config(stack, stream, schema, tasks=partitions * len(stream.topics()),
                                                     batch=batch))
    try:
        while done is None:
            if time.time() - launched > timeout:
                raise SystemExit(f"{label}: the JDBC sink did not reach the final state in {timeout:.0f} s")
            trace = _failed_task(hook, name)
            if trace:
                raise SystemExit(f"{label}: a JDBC sink task failed:\n{trace}")
            now, found = time.time(), _signatures(stack, schema, list(wanted))
            if first_row is None:
                if any(count for count, _, _ in found.values()):
                    first_row = empty_at
                else:
                    empty_at = now
            if found == wanted and not any(differences(schema).values()):
                done = now
            else:
                time.sleep(POLL_SECONDS)
    finally:
        hook.delete_connector(name)
    conn = pg_connect(stack)
    drop_schemas(conn, schema)
    conn.close()
    return {"launch_seconds": round(done - launched, 3), "batch_seconds": round(done - (first_row or launched), 3),
            "batches": None}
