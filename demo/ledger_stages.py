"""The ledger's part of the story: produced, streamed, its driver killed, a transaction left
open, snapshotted, damaged, recovered while a producer keeps committing, audited, stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Producer
from psycopg2 import sql

from demo.feed import Feed
from demo.lso_sampler import LsoSampler
from demo.names import (
    DRIVER_START_BUDGET,
    HEALTH,
    META,
    MIRROR_STREAM,
    ORDERS_PIPELINE,
    ORDERS_STREAM,
    ORDERS_TOPIC,
    PIPELINE,
    RECOVERY,
    SNAPSHOT,
    STREAM,
    TARGET,
    TOPIC,
)
from demo.orders_stages import OrdersStages
from spark_apps.eos_stream.kafka.client_logs import with_python_logging
from spark_apps.ledger.generator import ProduceSummary, ensure_topic, produce_ledger

OPEN_TRANSACTION_RECORDS = 20
# Committed just before the driver's SIGKILL, so that it dies with work in hand.
KILL_BURST = 1000
# The producer killed inside its transaction, and the successor that fences it.
KILLED_PRODUCER = "demo-killed-producer"
OPEN_TRANSACTION = """
import sys
from confluent_kafka import Producer
p = Producer({"bootstrap.servers": sys.argv[1], "transactional.id": sys.argv[4],
              "transaction.timeout.ms": int(sys.argv[3])})
p.init_transactions(30)
p.begin_transaction()
for i in range(20):  # OPEN_TRANSACTION_RECORDS
    p.produce(sys.argv[2], key=b"acct-00001", value=b'{"event_id": "never", "account_id": "acct-00001",'
              b' "amount_cents": 999999, "ts": "2026-01-01T00:00:00+00:00", "seq": -1}', partition=i % 4)
p.flush(30)
print("OPEN", flush=True)
import time; time.sleep(3600)
"""


@dataclass
class Recovery:
    """The recovery stage's part of the report."""

    # The recovery DAG's tasks and their seconds, in the order they ran.
    steps: list[tuple[str, float]]
    # What the ledger feed committed while the recovery ran.
    during: list[ProduceSummary]
    # What the orders stream did while the recovery held the ledger stopped.
    orders_through: dict[str, Any]


class LedgerStages(OrdersStages):
    """The ledger's stages and its part of the report."""

    def caught_up(self) -> bool:
        if not self.meta_ready():
            return False
        stored = self.stored_offsets(META, PIPELINE)
        lso = self.lso()
        return bool(lso) and all(stored.get((TOPIC, p), -1) >= offset for p, offset in lso.items())

    def lso(self) -> dict[int, int]:
        return self.sampler.latest(committed=True)

    def meta_ready(self) -> bool:
        """The app creates its bookkeeping tables when it first starts."""
        return self.query("SELECT to_regclass(%s)", (f"{META}.stream_progress",))[0][0] is not None

    def progress_runs(self) -> int:
        return self.driver_runs(META, PIPELINE)

    def stream_runs(self) -> list[str]:
        return [r["dag_run_id"] for r in self.api.recent_runs(STREAM)
                if (r.get("start_date") or "") >= self.started_at]

    def produce(self, bootstrap: str) -> ProduceSummary:
        """The ledger's first events, with aborted batches and one poison record; starts the LSO sampler.

        :returns: what the producer committed and aborted."""
        self.console.stage(f"producing {self.events} ledger events transactionally (aborted batches, "
                           "one poison record)")
        ensure_topic(bootstrap, TOPIC, partitions=4)
        ensure_topic(bootstrap, ORDERS_TOPIC, partitions=3)
        self.sampler = LsoSampler(bootstrap, [TOPIC, ORDERS_TOPIC])
        self.sampler.start()
        return produce_ledger(bootstrap, self.events, topic=TOPIC, abort_every=5, poison=1, seed=2026,
                              transactional_id="demo-generator")

    def start_ledger(self, mirror_started: Callable[[], bool]) -> None:
        """The ledger's stream, then the first batches of all three streams (they start side by
        side; ``mirror_started`` says the mirror's has); then the Spark streams' UI links."""
        c = self.console
        c.stage(f"triggering {STREAM} (Spark, exactly_once) and waiting for the first batches of all "
                "three streams")
        # Spark, 2 s batches of at most 4000 records, targets created: all in ledger.yaml.
        self.stream_run = self.api.trigger(STREAM, {})
        self.wait_until("first micro-batches of the ledger, orders and the mirror", lambda: (
            self.progress_runs() >= 1 and bool(self.spark_drivers()) and self.orders_batches() >= 1
            and mirror_started()), DRIVER_START_BUDGET)
        self.spark_ui = {STREAM: self.spark_ui_of(STREAM, self.stream_run),
                         MIRROR_STREAM: self.spark_ui_of(MIRROR_STREAM, self.mirror_run)}
        c.stage("each stream task links to its own driver's Spark UI: "
                + ", ".join(f"{dag} -> {ui['link']} ({'serves' if ui['serves'] else 'DOES NOT serve'})"
                            for dag, ui in self.spark_ui.items()))

    def kill_the_driver(self, bootstrap: str) -> ProduceSummary:
        """SIGKILL of the ledger's driver with events it has not applied yet; its operator restarts
        it while the next stages run (``ledger_back`` waits for it).

        :returns: what was committed just before the kill."""
        self.console.stage(f"{KILL_BURST} more events, then SIGKILL of the Spark driver mid-stream; "
                           "the operator restarts it")
        # The driver is frozen (SIGSTOP) before the burst is produced, so no batch can apply the
        # burst, however fast: a batch planned before the freeze ends at offsets the burst lies
        # past, and a frozen driver plans none. The kill then certainly lands with the burst
        # committed in Kafka and not applied, and the stored offsets read meanwhile cannot move.
        doomed = self.engines_to_kill(PIPELINE)
        self.signal_trees(doomed, signal.SIGSTOP)
        try:
            burst = produce_ledger(bootstrap, KILL_BURST, topic=TOPIC, seed=11, first_seq=5_000_000,
                                   transactional_id="demo-generator", batch_size=KILL_BURST)
            # The commit returns once the coordinator logged it; the partitions' markers, which move
            # the LSO, follow: wait for them, so the count below holds the whole burst.
            self.wait_until("the burst's commit markers", lambda: self.lso() == self.sampler.latest(committed=False),
                            60)
            stored, lso = self.stored_offsets(META, PIPELINE), self.lso()
        finally:
            self.signal_trees(doomed, signal.SIGKILL)
        self.behind_at_kill = sum(max(0, offset - stored.get((TOPIC, p), 0)) for p, offset in lso.items())
        return burst

    def ledger_back(self) -> None:
        """The ledger's restarted driver committing batches, caught up with the LSO."""
        self.console.stage(f"{STREAM}'s restarted driver commits batches and catches up")
        self.wait_until("restarted driver's batches", lambda: self.progress_runs() >= 2, DRIVER_START_BUDGET)
        self.wait_until("stream caught up with the LSO", self.caught_up, 300)

    def hang_a_transaction(self, bootstrap: str) -> ProduceSummary:
        """A producer killed inside its transaction: the health DAG catches the stuck LSO; the
        producer's successor fences it, so the coordinator aborts the transaction; the stream resumes.

        :returns: what was committed behind the open transaction."""
        c = self.console
        c.stage("a producer dies inside an open transaction; more events queue behind it")
        child = subprocess.Popen([sys.executable, "-c", OPEN_TRANSACTION, bootstrap, TOPIC,
                                  str(self.open_txn_timeout_ms), KILLED_PRODUCER], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "OPEN"
        child.send_signal(signal.SIGKILL)
        child.wait()
        killed_at = time.monotonic()
        more = produce_ledger(bootstrap, 2000, topic=TOPIC, seed=7, first_seq=10_000_000,
                              transactional_id="demo-generator")

        c.stage(f"{HEALTH} (deferrable LSO sensor on the triggerer) must catch the stuck LSO")
        self.health_run = self.run_dag(HEALTH, {}, budget=300, expect="failed")
        self.timings["stuck LSO detected after (s)"] = round(time.monotonic() - killed_at, 1)

        c.stage("the dead producer's successor starts with its transactional.id: the coordinator aborts "
                "the open transaction; the stream resumes")
        # As a restarted producer does: init_transactions fences the dead instance's epoch, and the
        # coordinator aborts its transaction then, not after transaction.timeout.ms (the backstop).
        # While it aborts, the coordinator answers "concurrent transactions", which librdkafka retries
        # and would log as a warning (log_level 3: errors only).
        Producer(with_python_logging({"bootstrap.servers": bootstrap, "transactional.id": KILLED_PRODUCER,
                                      "log_level": 3})).init_transactions(60)
        # The SIGKILLed driver's successor may still be starting: it catches up once it runs.
        self.wait_until("LSO lag back to 0 and stream caught up",
                        lambda: all(v == 0 for v in self.sampler.lag().values()) and self.caught_up(),
                        DRIVER_START_BUDGET)
        return more

    def snapshot_then_produce(self, bootstrap: str) -> ProduceSummary:
        """A snapshot, then events it does not hold, applied by the stream.

        :returns: what was committed after the snapshot."""
        c = self.console
        c.stage(f"{SNAPSHOT}: consistent pg_dump with its Kafka offsets")
        self.api.unpause(SNAPSHOT)
        run_id = self.run_dag(SNAPSHOT, {}, budget=300)
        # The recovery restores this snapshot by its id, not "latest": unpausing the DAG also
        # creates its first scheduled run (hourly, catchup off), which may run after this one and
        # after the damage below, and "latest" would then be a snapshot of the damaged target.
        self.snapshot_id = str(self.api.xcom(SNAPSHOT, run_id, "snapshot")["snapshot_id"])

        c.stage("more events after the snapshot")
        later = produce_ledger(bootstrap, max(2000, self.events // 4), topic=TOPIC, seed=99,
                               first_seq=20_000_000, transactional_id="demo-generator")
        self.wait_until("stream caught up with the LSO", self.caught_up, 300)
        return later

    def damage_the_target(self) -> dict[str, Any]:
        """Deleted and duplicated rows, corrupted balances.

        :returns: the audit of the damaged target."""
        self.console.stage("damaging the target: deleted rows, duplicated rows, corrupted balances")
        self.query(sql.SQL("DELETE FROM {}.ledger_events WHERE ctid IN (SELECT ctid FROM {}.ledger_events "
                           "ORDER BY random() LIMIT 100)").format(sql.Identifier(TARGET), sql.Identifier(TARGET)))
        self.query(sql.SQL("INSERT INTO {t}.ledger_events SELECT * FROM {t}.ledger_events LIMIT 50").format(
            t=sql.Identifier(TARGET)))
        self.query(sql.SQL("UPDATE {}.account_balances SET balance_cents = balance_cents + 777 WHERE account_id IN "
                           "(SELECT account_id FROM {}.account_balances LIMIT 10)").format(
            sql.Identifier(TARGET), sql.Identifier(TARGET)))
        return self.final_audit()

    def recover(self, bootstrap: str) -> Recovery:
        """The recovery DAG from the story's snapshot, while a producer keeps committing ledger events.

        :returns: its steps, the feed's production, and what the orders stream did meanwhile."""
        self.console.stage(f"{RECOVERY}: gate, stop, restore, replay, caught up, audit, resume; the ledger's "
                           f"producer keeps committing and {ORDERS_STREAM} keeps streaming")
        orders_engines = {process.pid for process in self.stream_engines(ORDERS_PIPELINE)}
        # A live topic is the normal case: what is committed after the replay started is the
        # resumed stream's work, and the final audit below holds it to it.
        ledger_feed = Feed(lambda tick: produce_ledger(
            bootstrap, 200, topic=TOPIC, batch_size=50, abort_every=4, seed=5000 + tick,
            first_seq=30_000_000 + tick * 10_000, transactional_id="demo-ledger-feed"), name="ledger feed")
        ledger_feed.start()
        try:
            recovery = self.run_dag(RECOVERY, {"snapshot": self.snapshot_id}, budget=900)
        finally:
            during = ledger_feed.stop()
        instances = self.api.task_instances(RECOVERY, recovery)
        # In the order they ran.
        ran = sorted((ti for ti in instances if ti.get("duration") is not None),
                     key=lambda ti: ti.get("start_date") or "")
        return Recovery(steps=[(ti["task_id"], round(float(ti["duration"]), 2)) for ti in ran], during=during,
                        orders_through=self.orders_through_recovery(recovery, instances, orders_engines))

    def audit_the_ledger(self) -> dict[str, Any]:
        """:returns: the ledger's final audit, once its stream caught up with the LSO."""
        self.console.stage("final audit of the ledger against everything Kafka committed")
        self.wait_until("stream caught up with the LSO", self.caught_up, 300)
        return self.final_audit()

    def stop_the_ledger(self) -> None:
        """A stop request the ledger's driver honours at a batch boundary."""
        self.console.stage("stopping the ledger stream at a batch boundary")
        self.query(sql.SQL("INSERT INTO {}.stream_control (pipeline, stop_requested_at, requested_by)"
                           " VALUES (%s, now(), 'demo') ON CONFLICT (pipeline) DO UPDATE SET"
                           " stop_requested_at = now(), requested_by = 'demo'").format(sql.Identifier(META)),
                   (PIPELINE,))
        self.wait_until("no Spark driver left", lambda: not self.spark_drivers(), 180)
        self.sampler.stop_event.set()

    def wait_for_stream_runs(self) -> None:
        """Waits until every ledger stream run of this story has ended, and records their states."""
        self.wait_until(f"{STREAM} runs to end", lambda: all(
            self.api.run_state(STREAM, run_id) not in ("queued", "running") for run_id in self.stream_runs()), 120)
        for run_id in self.stream_runs():
            self.runs[f"{STREAM} ({run_id})"] = self.api.run_state(STREAM, run_id)

    def ledger_result(self, final: dict[str, Any], damaged: dict[str, Any], batches: tuple[ProduceSummary, ...],
                      steps: list[tuple[str, float]]) -> dict[str, Any]:
        """The ledger's part of the report.

        :param final: its final audit.
        :param damaged: the audit of the damaged target.
        :param batches: every ledger production of the story but the open transaction.
        :param steps: the recovery's tasks and their seconds, in the order they ran."""
        summary = final["summary"]
        committed = sum(b.committed + b.poison + b.malformed for b in batches)
        aborted = sum(b.aborted for b in batches) + OPEN_TRANSACTION_RECORDS
        return {
            "events_produced": committed + aborted,
            "events_committed_by_producers": committed,
            "events_committed_in_kafka (audit)": summary["committed_records"],
            "events_aborted_or_left_open": aborted,
            "rows_in_db": sum(p["rows"] for p in final["partitions"].values()),
            "duplicates": summary["duplicated"],
            "missing": summary["missing"],
            "balances_exact": final["aggregates"]["account_balances"]["keys_wrong"] == 0,
            "dead_lettered": summary["dead_lettered"],
            "damage_seen_before_recovery": {"duplicated": damaged["summary"]["duplicated"],
                                            "missing": damaged["summary"]["missing"],
                                            "balances_wrong": damaged["aggregates"]["account_balances"]["keys_wrong"]},
            "offsets behind at the SIGKILL": self.behind_at_kill,
            **self.timings,
            "recovery_steps_s": dict(steps),
            "tasks_seen_deferred": sorted(self.deferred),
            # Why the health DAG failed, as its task's log in Airflow says: one line and the log's path.
            "health_failed_because": "; ".join(f"{task}: {why}" for task, why in self.failures.get(HEALTH, {}).items()),
            "ledger_exact": final["ok"],
        }
