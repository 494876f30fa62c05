"""The mirror pipeline's part of the story: an application keeps changing three tables of the
source database; Debezium, on Kafka Connect, publishes each change; ``eos_stream__shop_mirror``
applies them to a mirror and an aggregate, on Spark. The Connect worker and the mirror's Spark driver
are each SIGKILLed once while the application writes; at the end every mirror table is compared with
its source and the aggregate with its GROUP BY."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

import psutil
import psycopg2
from psycopg2 import sql

from airflow_provider_eos.utils.debezium_config import postgres_connector_config
from demo.cdc_app import (
    AGGREGATE,
    LAST_CHANGES,
    SOURCE_DDL,
    TABLES,
    Workload,
    change_topics,
    compare,
    holds_last_changes,
    write_transaction,
)
from demo.env_files import STATE_DIR
from demo.names import (
    CONNECTOR_PREFIX,
    DRIVER_START_BUDGET,
    MIRROR_META,
    MIRROR_PIPELINE,
    MIRROR_STOP,
    MIRROR_STREAM,
    MIRROR_TARGET,
    SLOT_PREFIX,
    SOURCE_SCHEMA,
    TOPIC_PREFIX,
)
from demo.story_base import StoryBase

CONNECT_CONN = "eos_demo_connect"
# Rows for the connector's initial snapshot (op 'r'), written before it starts.
SNAPSHOT_TRANSACTIONS = 5
# Seconds between two of the application's transactions: a few a second keeps three tables busy
# without starving the two streams beside it on two cores.
APPLICATION_PAUSE = (0.15, 0.45)


class MirrorStages(StoryBase):
    """The mirror pipeline's stages and its part of the report."""

    workload: Workload
    workload_thread: threading.Thread
    connector: str
    mirror_run: str
    mirror_faults: dict[str, Any]

    def connect_started(self) -> float:
        """Waits for ``start_connect``; :returns: the seconds waited."""
        started = time.monotonic()
        assert self.connect_start is not None
        if self.connect_start.wait(240) != 0:
            raise RuntimeError("scripts/stack.sh start-connect failed: see .local/connect/connect.log")
        return time.monotonic() - started

    def connect_hook(self):
        from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook

        host, port = self.stack["EOS_CONNECT_URL"].removeprefix("http://").split(":")
        os.environ[f"AIRFLOW_CONN_{CONNECT_CONN.upper()}"] = json.dumps(
            {"conn_type": "kafka_connect", "host": host, "port": int(port), "schema": "http"})
        return KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)

    def source_db(self):
        conn = psycopg2.connect(host=self.stack["EOS_PG_HOST"], port=self.stack["EOS_PG_PORT"],
                                dbname=self.stack["EOS_SOURCE_PG_DB"], user=self.stack["EOS_PG_USER"],
                                password=self.stack["EOS_PG_PASSWORD"])
        conn.autocommit = True
        return conn

    def mirror_driver_runs(self) -> int:
        return self.driver_runs(MIRROR_META, MIRROR_PIPELINE)

    def mirror_started(self) -> bool:
        """The mirror's driver runs and has committed its first batch."""
        return self.mirror_driver_runs() >= 1 and bool(self.stream_engines(MIRROR_PIPELINE))

    def reset_mirror(self) -> None:
        """A rerun starts clean: earlier runs' connectors and slots, the source schema, the change
        topics, the mirror's schemas and checkpoints."""
        from confluent_kafka.admin import AdminClient

        from spark_apps.eos_stream.kafka.client_logs import with_python_logging

        hook = self.connect_hook()
        for name in hook.list_connectors():
            if name.startswith(CONNECTOR_PREFIX):
                hook.delete_connector(name)
        source = self.source_db()
        try:
            def slots_dropped() -> bool:
                with source.cursor() as cur:
                    cur.execute("SELECT slot_name, active FROM pg_replication_slots WHERE slot_name LIKE %s",
                                (f"{SLOT_PREFIX}%",))
                    slots = cur.fetchall()
                    for slot, active in slots:
                        if not active:
                            cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                    return not any(active for _, active in slots)

            self.wait_until("earlier runs' replication slots dropped", slots_dropped, 60)
            with source.cursor() as cur:
                cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {s} CASCADE; CREATE SCHEMA {s}").format(
                    s=sql.Identifier(SOURCE_SCHEMA)))
        finally:
            source.close()
        admin = AdminClient(with_python_logging({"bootstrap.servers": self.stack["EOS_KAFKA_BOOTSTRAP"]}))
        topics = change_topics(TOPIC_PREFIX, SOURCE_SCHEMA)
        old = [t for t in topics if t in admin.list_topics(timeout=10).topics]
        for future in admin.delete_topics(old).values() if old else ():
            future.result(30)
        self.wait_until("old change topics deleted",
                        lambda: not set(topics) & set(admin.list_topics(timeout=10).topics), 60)
        self.query(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(MIRROR_TARGET)))
        self.query(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(MIRROR_META)))
        subprocess.run(["rm", "-rf", str(STATE_DIR / "checkpoints-shop")], check=True)

    def start_mirror(self) -> None:
        """The application's tables and first rows, Debezium's connector (through Connect's REST
        API), the mirror's stream; then the application keeps writing until the mirror's audit."""
        self.console.stage(f"an application changes {len(TABLES)} tables of the source database; Debezium's "
                           f"connector, created through Kafka Connect's REST API, publishes every change; "
                           f"{MIRROR_STREAM} mirrors them")
        self.connect_started()
        self.reset_mirror()
        source = self.source_db()
        write_transaction(source, SOURCE_SCHEMA, SOURCE_DDL)
        self.workload = Workload(source, SOURCE_SCHEMA, seed=2035, pause=APPLICATION_PAUSE)
        for _ in range(SNAPSHOT_TRANSACTIONS):
            self.workload.transaction()
        stamp = time.strftime("%Y%m%d%H%M%S", time.gmtime())
        self.connector, slot = f"{CONNECTOR_PREFIX}-{stamp}", f"{SLOT_PREFIX}_{stamp}"
        hook = self.connect_hook()
        # The password is a ${file:...} reference the worker resolves: never in this config.
        hook.put_connector_config(self.connector, postgres_connector_config(
            self.stack, TOPIC_PREFIX, slot, [f"{SOURCE_SCHEMA}.{table}" for table in TABLES]))
        self.wait_until(f"connector {self.connector} RUNNING", lambda: not hook.connector_problems(self.connector), 120)
        self.wait_until("the change topics", self.change_topics_written, 120)
        # Spark, 2 s batches, targets created from the definition: all in shop_mirror.yaml.
        self.mirror_run = self.api.trigger(MIRROR_STREAM, {})
        self.workload_thread = threading.Thread(target=self.workload.run, args=(3600,), daemon=True,
                                                name="shop application")
        self.workload_thread.start()

    def change_topics_written(self) -> bool:
        ends = self.committed_ends(change_topics(TOPIC_PREFIX, SOURCE_SCHEMA))
        return bool(ends) and all(ends.values())

    def kill_connect_and_the_mirror_driver(self) -> None:
        """SIGKILL of the Connect worker (restarted in the background) and of the mirror's driver
        (its operator restarts it), while the application writes."""
        self.console.stage(f"SIGKILL of the Kafka Connect worker and of {MIRROR_PIPELINE}'s Spark driver while "
                           "the application writes; Connect is restarted, the operator restarts the driver")
        self.wait_until(f"{MIRROR_PIPELINE}'s first batches", self.mirror_started, DRIVER_START_BUDGET)
        pid = int((STATE_DIR / "connect" / "connect.pid").read_text())
        worker = psutil.Process(pid)
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        self.mirror_faults = {"transactions before the kills": self.workload.transactions,
                              "connect_worker_killed": pid}
        killed_at = time.monotonic()
        self.start_connect()
        drivers = self.engines_to_kill(MIRROR_PIPELINE)
        self.signal_trees(drivers, signal.SIGKILL)
        self.mirror_faults["drivers_killed"] = [process.pid for process, _ in drivers]
        self.mirror_faults["killed_at"] = killed_at

    def mirror_back(self) -> None:
        """The worker back with the connector RUNNING; the restarted driver committing batches."""
        self.console.stage(f"Kafka Connect is back with its connector RUNNING; {MIRROR_PIPELINE}'s restarted "
                           "driver commits batches")
        self.connect_started()
        hook = self.connect_hook()
        self.wait_until(f"connector {self.connector} RUNNING", lambda: not hook.connector_problems(self.connector), 120)
        self.wait_until(f"{MIRROR_PIPELINE}'s restarted driver's batches", lambda: self.mirror_driver_runs() >= 2,
                        DRIVER_START_BUDGET)
        self.mirror_faults["back_after_s"] = round(time.monotonic() - self.mirror_faults.pop("killed_at"), 1)

    def audit_and_stop_mirror(self) -> dict[str, Any]:
        """Stops the application, compares once the mirror caught up, stops the stream.

        :returns: the mirror's part of the report."""
        self.console.stage(f"the application stops; once {MIRROR_PIPELINE} caught up with the change topics, "
                           f"each mirror table is compared with its source; {MIRROR_STOP} stops the stream")
        self.workload.stop.set()
        self.workload_thread.join(60)
        if self.workload.error is not None:
            raise RuntimeError(f"the shop application failed: {self.workload.error}") from self.workload.error
        write_transaction(self.workload.conn, SOURCE_SCHEMA, LAST_CHANGES)
        topics = change_topics(TOPIC_PREFIX, SOURCE_SCHEMA)
        target = self.db()
        try:
            self.wait_until(f"{MIRROR_PIPELINE} caught up with the application's last transaction", lambda: (
                holds_last_changes(target, MIRROR_TARGET)
                and self.caught_up_with(MIRROR_META, MIRROR_PIPELINE, topics)), 300)
            compared = compare(self.workload.conn, SOURCE_SCHEMA, target, MIRROR_TARGET)
        finally:
            target.close()
            self.workload.conn.close()
        dead = self.query(sql.SQL("SELECT count(*) FROM {}.dead_letters").format(sql.Identifier(MIRROR_META)))[0][0]
        changes = sum(self.stored_offsets(MIRROR_META, MIRROR_PIPELINE).values())
        self.run_dag(MIRROR_STOP, {}, budget=300)
        self.wait_until(f"{MIRROR_STREAM} run to end",
                        lambda: self.api.run_state(MIRROR_STREAM, self.mirror_run) not in ("queued", "running"), 120)
        self.runs[f"{MIRROR_STREAM} ({self.mirror_run})"] = self.api.run_state(MIRROR_STREAM, self.mirror_run)
        return self.mirror_result(compared, int(dead), changes)

    def mirror_result(self, compared: dict[str, tuple[int, int]], dead: int, changes: int) -> dict[str, Any]:
        faults = self.mirror_faults
        tables = {table: {"source_rows": rows, "differ": differ} for table, (rows, differ) in compared.items()
                  if table != AGGREGATE}
        rows, differ = compared[AGGREGATE]
        return {
            "source_transactions": self.workload.transactions + 1,
            "change_events_in_kafka": changes,
            "connect_worker_sigkilled": f"pid {faults['connect_worker_killed']}, after "
                                        f"{faults['transactions before the kills']} transactions; restarted",
            "driver_sigkilled": f"pid(s) {faults['drivers_killed']}; the operator restarted it",
            "back_after_s": faults["back_after_s"],
            "driver_runs": self.mirror_driver_runs(),
            "tables": tables,
            "aggregate": {"table": AGGREGATE, "group_by": "sku", "groups": rows, "differ": differ},
            "dead_lettered": dead,
            "exact": bool(tables) and all(t["differ"] == 0 and t["source_rows"] > 0 for t in tables.values())
            and differ == 0 and rows > 0 and dead == 0,
        }
