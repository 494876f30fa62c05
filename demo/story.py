"""The main job: every promise of the project, on one machine, through Airflow.

Starts the local stack (with Kafka Connect) and Airflow's real services (api-server, scheduler,
dag-processor, triggerer), then drives the DAGs through the REST API:

 1. produce ledger events transactionally (with aborted batches and a poison record);
 2. start ``eos_stream__ledger``, freeze its Spark driver, commit a burst, SIGKILL the driver;
 3. leave an open transaction behind a killed producer; ``eos_health__ledger`` catches the stuck LSO;
    the producer's successor (same transactional.id) fences it and the transaction aborts;
 4. snapshot with ``eos_snapshot__ledger``, keep streaming, then damage the target;
 5. ``eos_recovery__ledger`` restores, replays from the snapshot's offsets, audits and resumes,
    while a producer keeps committing ledger events (a live topic, the normal case);
 6. a final audit against Kafka, a report on the terminal and in HTML.

A second pipeline of another shape, ``orders`` (spark_apps/orders: order lines and sales per
(sku, store)), streams on the continuous engine through its own ``eos_stream__orders`` the whole
time (the report gives the time from a commit to its lines in the target), undisturbed by
the ledger's crash, hanging transaction and recovery, and is audited exactly at the end. A
feed commits order lines every 2 s, so the report can show that the orders stream committed
batches while the ledger's recovery held the ledger stopped, with the same DAG run and the
same engine process before and after.

A third, ``shop_mirror``, is a change stream: an application keeps changing three tables of the
source database in multi-row transactions; Debezium on Kafka Connect (its connector created
through Connect's REST API) publishes each change; ``eos_stream__shop_mirror`` applies them to a
mirror and an aggregate on Spark, from a declarative definition. The Connect worker and the
mirror's Spark driver are each SIGKILLed once while the application writes; at the end each mirror table is
compared with its source and the aggregate with its GROUP BY.

    .venv/bin/python -m demo.story                   (what `make demo` runs: Spark on local[*])
    .venv/bin/python -m demo.story --spark-cluster   (`make demo SPARK=cluster`: on the local
        standalone cluster of `scripts/stack.sh start-spark`, which it starts; spark_default points
        at its master, so both streams and the recovery's replay run there, one core each)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from demo.airflow_views import AirflowViews  # noqa: E402
from demo.console import print_report, quiet_console  # noqa: E402
from demo.ledger_stages import LedgerStages  # noqa: E402
from demo.mirror_stages import MirrorStages  # noqa: E402
from demo.names import CONSOLE_LOG, DOWNSTREAM, TASK_LOGS  # noqa: E402


class Story(LedgerStages, MirrorStages, AirflowViews):
    """The story's stages in order: the ledger's (``ledger_stages``), the orders pipeline's
    (``orders_stages``), the mirror's (``mirror_stages``), and what Airflow saw (``airflow_views``)."""

    def run(self) -> dict[str, Any]:
        """The story's stages in order (each section prints its own), then the report of both pipelines."""
        airflow_env = self.start()
        bootstrap = self.stack["EOS_KAFKA_BOOTSTRAP"]
        produced = self.produce(bootstrap)
        orders_produced, feed = self.start_orders(bootstrap)
        self.start_mirror()
        # The three drivers start side by side: one wait for all their first batches.
        self.start_ledger(self.mirror_started)
        burst = self.kill_the_driver(bootstrap)
        # The faults overlap the ledger's hanging transaction: the restarts of the two drivers and of
        # the Connect worker are waited for after the health DAG's run.
        self.kill_connect_and_the_mirror_driver()
        more = self.hang_a_transaction(bootstrap)
        self.ledger_back()
        self.mirror_back()
        later = self.snapshot_then_produce(bootstrap)
        damaged = self.damage_the_target()
        recovery = self.recover(bootstrap)
        # The other two are audited while the ledger's resumed stream starts its driver.
        orders_final = self.audit_and_stop_orders(feed, orders_produced)
        mirror = self.audit_and_stop_mirror()
        final = self.audit_the_ledger()
        self.stop_the_ledger()
        assets, lineage = self.airflow_views(airflow_env)
        self.wait_for_stream_runs()
        result = self.ledger_result(final, damaged, (produced, burst, more, later, *recovery.during), recovery.steps)
        result["orders"] = self.orders_result(orders_final, orders_produced, recovery.orders_through)
        result["mirror"] = mirror
        result["exact"] = final["ok"] and orders_final["ok"] and mirror["exact"]
        result["assets"] = assets
        result["lineage"] = lineage
        result["spark"] = {"master": self.spark_master, "applications": self.cluster_applications(),
                           "driver_ui": self.spark_ui}
        self.write_html(result, recovery.steps)
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The smallest first production that shows every stage (its fifth transaction of 1000 is the
    # aborted one); more events show nothing more, and take longer.
    parser.add_argument("--events", type=int, default=5_000,
                        help="ledger events of the first production (order lines: half as many)")
    parser.add_argument("--open-txn-timeout-ms", type=int, default=300_000,
                        help="transaction.timeout.ms of the producer that dies inside its transaction: the "
                             "coordinator's own abort, should the story not fence it (below the broker's "
                             "transaction.max.timeout.ms)")
    parser.add_argument("--json", help="also write the final report as JSON to this file")
    parser.add_argument("--spark-cluster", action="store_true",
                        help="run Spark on the local standalone cluster (scripts/stack.sh start-spark, started "
                             "here) instead of local[*]: spark_default points at its master")
    args = parser.parse_args()
    terminal = quiet_console(CONSOLE_LOG)
    story = Story(args.events, args.open_txn_timeout_ms, spark_cluster=args.spark_cluster)
    try:
        result = story.run()
    except BaseException as exc:
        print(f"\nthe demo stopped: {type(exc).__name__}: {exc}\n(the whole traceback and every log line: "
              f"{CONSOLE_LOG})", file=terminal, flush=True)
        logging.getLogger("demo").exception("the demo stopped")
        return 2
    print_report(result, DOWNSTREAM)
    print(f"\nHTML report: {story.report_path}")
    print(f"Airflow UI:  {story.ui}  ({story.login_hint})")
    print(f"Logs:        {CONSOLE_LOG} (this console's), {TASK_LOGS}/ (failed tasks')")
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "report_html": str(story.report_path),
                                               "runs": story.runs, "failure_logs": story.failure_logs},
                                              indent=2, default=str))
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
