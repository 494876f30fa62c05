"""The orders pipeline's part of the story: a second shape that streams, undisturbed, from its
start to the end while the ledger crashes, hangs and is recovered. It runs on the continuous engine,
as a live sales view would: the report says how soon a committed order reaches the target."""

from __future__ import annotations

import statistics
import time
from typing import Any

from psycopg2 import sql

from demo.feed import Feed
from demo.names import (
    ORDERS_META,
    ORDERS_PIPELINE,
    ORDERS_STOP,
    ORDERS_STREAM,
    ORDERS_TARGET,
    ORDERS_TOPIC,
    RECOVERY,
)
from demo.story_base import StoryBase
from spark_apps.orders.generator import OrdersSummary, produce_orders
from spark_apps.orders.spec import LINES_TABLE

# A feed's tick that is not visible by then counts as this late (the report's max shows it).
VISIBLE_WITHIN = 30.0


class OrdersStages(StoryBase):
    """The orders pipeline's stages and its part of the report."""

    # Seconds from a feed tick's commit (``commit_transaction`` returned) to all of its lines in the target.
    visible_after: list[float]
    # The feed's own session for that timing, closed once the feed has stopped.
    orders_probe: Any

    def orders_feed(self, bootstrap: str, lines_per_tick: int) -> Feed:
        """Keeps order lines flowing for the whole story, so the orders stream has work to commit
        while the ledger crashes, hangs and is recovered (every other transaction aborts). After
        each tick it times how long the tick's committed lines take to be in the target."""
        self.visible_after = []
        self.orders_probe = probe = self.db()
        count = sql.SQL("SELECT count(*) FROM {}.{} WHERE seq BETWEEN %s AND %s").format(
            sql.Identifier(ORDERS_TARGET), sql.Identifier(LINES_TABLE))

        def tick(n: int) -> OrdersSummary:
            first = n * 1_000_000
            summary = produce_orders(bootstrap, lines_per_tick, topic=ORDERS_TOPIC, orders_per_transaction=20,
                                     abort_every=2, seed=3000 + n, first_seq=first,
                                     transactional_id="demo-orders-feed")
            committed_at = time.monotonic()
            # The tick's last transaction commits (aborted ones are extra), so its lines end here.
            last = first + summary.committed + summary.aborted - 1
            with probe.cursor() as cur:
                cur.execute("SELECT to_regclass(%s)", (f"{ORDERS_TARGET}.{LINES_TABLE}",))
                if cur.fetchone()[0] is None:
                    return summary  # the engine has not created its targets yet: nothing to time
                while time.monotonic() - committed_at < VISIBLE_WITHIN:
                    cur.execute(count, (first, last))
                    if cur.fetchone()[0] >= summary.committed:
                        break
                    time.sleep(0.01)
            self.visible_after.append(time.monotonic() - committed_at)
            return summary

        return Feed(tick, name="orders feed")

    def orders_latency(self) -> dict[str, Any]:
        """:returns: the feed's commit-to-visible times: percentiles in milliseconds, and how many ticks."""
        times = sorted(self.visible_after)
        if not times:
            return {"ticks": 0}
        deciles = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
        return {"ticks": len(times), "p50_ms": round(statistics.median(times) * 1000),
                "p90_ms": round(deciles[8] * 1000), "max_ms": round(times[-1] * 1000)}

    def orders_batches(self) -> int:
        """Batches the orders pipeline committed so far."""
        if self.query("SELECT to_regclass(%s)", (f"{ORDERS_META}.stream_progress",))[0][0] is None:
            return 0
        rows = self.query(sql.SQL("SELECT count(*) FROM {}.stream_progress WHERE pipeline = %s").format(
            sql.Identifier(ORDERS_META)), (ORDERS_PIPELINE,))
        return int(rows[0][0])

    def orders_through_recovery(self, recovery: str, instances: list[dict[str, Any]],
                                engines_before: set[int]) -> dict[str, Any]:
        """What the orders stream did while the ledger was stopped by its recovery (from the ledger's
        ``stop_stream`` to its ``resume_stream``): it kept its run and engine process and kept committing."""
        tasks = {ti["task_id"]: ti for ti in instances}
        down_from = tasks["stop_stream"]["start_date"]
        down_to = (tasks.get("resume_stream") or {}).get("end_date") or self.api.run(RECOVERY, recovery)["end_date"]
        batches, rows, seconds = self.query(sql.SQL(
            "SELECT count(*) FILTER (WHERE input_rows > 0), coalesce(sum(input_rows), 0),"
            " extract(epoch FROM %s::timestamptz - %s::timestamptz)"
            " FROM {}.stream_progress WHERE pipeline = %s AND recorded_at BETWEEN %s AND %s").format(
            sql.Identifier(ORDERS_META)), (down_to, down_from, ORDERS_PIPELINE, down_from, down_to))[0]
        runs = [r["dag_run_id"] for r in self.api.recent_runs(ORDERS_STREAM)
                if (r.get("start_date") or "") >= self.started_at]
        engines_after = {process.pid for process in self.stream_engines(ORDERS_PIPELINE)}
        return {
            "ledger_stopped_s": round(float(seconds), 1),
            "batches_while_ledger_stopped": int(batches),
            "records_while_ledger_stopped": int(rows),
            "stream_runs": len(runs),
            "stream_run_state_after": self.api.run_state(ORDERS_STREAM, self.orders_run),
            "same_engine": bool(engines_before) and engines_before == engines_after,
        }

    def orders_caught_up(self) -> bool:
        return self.caught_up_with(ORDERS_META, ORDERS_PIPELINE, [ORDERS_TOPIC])

    def start_orders(self, bootstrap: str) -> tuple[list[OrdersSummary], Feed]:
        """Order lines, then the orders stream, then the feed that keeps it busy to the end.

        :returns: what was produced so far, and the running feed."""
        self.console.stage(f"order lines (aborted transactions, rejected and malformed lines) into {ORDERS_STREAM}, "
                           "a second pipeline of another shape that streams from now to the end")
        produced = [produce_orders(bootstrap, self.events // 2, topic=ORDERS_TOPIC, abort_every=5,
                                   malformed=1, rejected=2, seed=2027, transactional_id="demo-orders")]
        # The continuous engine, its own target and meta schemas: all in orders.yaml. It starts
        # while the mirror and the ledger are set up; start_ledger waits for all three.
        self.orders_run = self.api.trigger(ORDERS_STREAM, {})
        feed = self.orders_feed(bootstrap, lines_per_tick=max(100, self.events // 50))
        feed.start()
        return produced, feed

    def audit_and_stop_orders(self, feed: Feed, produced: list[OrdersSummary]) -> dict[str, Any]:
        """Stops the orders feed (its production joins ``produced``), audits the orders pipeline once
        caught up, and stops its stream through its stop DAG.

        :returns: the orders pipeline's final audit."""
        self.console.stage(f"the orders feed stops; final audit of {ORDERS_PIPELINE}, then {ORDERS_STOP} "
                           "stops its stream")
        produced.extend(feed.stop())
        self.orders_probe.close()
        self.wait_until("orders stream caught up with the LSO", self.orders_caught_up, 300)
        orders_final = self.final_audit(ORDERS_PIPELINE)
        self.run_dag(ORDERS_STOP, {}, budget=300)
        self.wait_until(f"{ORDERS_STREAM} run to end",
                        lambda: self.api.run_state(ORDERS_STREAM, self.orders_run) not in ("queued", "running"), 120)
        self.runs[f"{ORDERS_STREAM} ({self.orders_run})"] = self.api.run_state(ORDERS_STREAM, self.orders_run)
        return orders_final

    def orders_result(self, final: dict[str, Any], produced: list[OrdersSummary],
                      through_recovery: dict[str, Any]) -> dict[str, Any]:
        """The orders pipeline's part of the report.

        :param final: its final audit.
        :param produced: every orders production of the story.
        :param through_recovery: what its stream did while the ledger's recovery held the ledger stopped."""
        committed = sum(p.committed + p.rejected + p.malformed for p in produced)
        aborted = sum(p.aborted for p in produced)
        sales = final["aggregates"]["sku_store_sales"]
        return {
            "lines_produced": committed + aborted,
            "lines_committed_by_producers": committed,
            "lines_committed_in_kafka (audit)": final["summary"]["committed_records"],
            "lines_aborted": aborted,
            "rows_in_db": sum(p["rows"] for p in final["partitions"].values()),
            "duplicates": final["summary"]["duplicated"],
            "missing": final["summary"]["missing"],
            "sales_keys": sales["keys"],
            "sales_exact": sales["keys_wrong"] == 0,
            "dead_lettered": final["summary"]["dead_lettered"],
            "through_the_ledger_recovery": through_recovery,
            "committed_to_visible (continuous engine)": self.orders_latency(),
            "exact": final["ok"],
        }
