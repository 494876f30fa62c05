"""Debezium's publish rate of a backlog of changes against the mirror's apply rate of the same
changes, in the same run.

    .venv/bin/python bench/cdc_publish_rate.py --rows 100000 --runs 3

Method. Each run makes a fresh source table ``items`` of ``--rows`` rows (the columns of
``bench/cdc_snapshot.py``) and a fresh connector on it (``postgres_connector_config`` with
``snapshot.mode=no_data``: only what changes afterwards), waits until it runs, and pauses it. The
source then changes in transactions of 5,000 rows, set-based: every row updated twice, a fifth
of ``--rows`` inserted and as many deleted (Debezium writes a tombstone after each delete). The
changes wait in the replication slot. Then:

* **Debezium**: the connector is resumed; its clock runs from the resume to the change topic's
  last stable offset at its final value (Kafka ``read_committed``, sampled every 0.25 s);
* **the mirror**: launched once Debezium is done, on Spark (``local[2]``, ``processingTime``) or
  the continuous engine, ``max_offsets_per_trigger`` = ``--batch``; its clock runs from its first
  batch's start to the commit of the batch that reached the topic's end (the batches clock; the
  launch clock adds the start).

A rate is changes (tombstones not counted) over a clock. Each run ends by comparing the mirror with
its source (count and an md5 over every row's text); a run whose mirror differs stops the bench.
Engines alternate (``bench.common.in_turn``); figures are medians.

Writes ``--out`` (bench/results/cdc_publish_rate.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from psycopg2 import sql

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook  # noqa: E402
from bench.cdc_snapshot import (  # noqa: E402
    Source,
    StableOffsets,
    batch_committed_at,
    engine_arguments,
    finish_run,
    run_engines,
    start_mirror,
    verify_mirror,
)
from bench.common import CONNECT_CONN, end_offsets_sum, load_average  # noqa: E402
from bench.harness import AppRun, source_connection, topics_exist, wait_until  # noqa: E402

TRANSACTION_ROWS = 5000
FIGURES = ("debezium", "mirror_batches", "mirror_launch")


def _change_source(source: Source) -> int:
    """Every row updated twice, a fifth of the rows inserted and as many deleted, in transactions
    of TRANSACTION_ROWS rows; returns the number of changes."""
    schema, rows, changes = sql.Identifier(source.name), source.rows, 0
    update = sql.SQL("UPDATE {}.items SET qty = qty + 1, name = name || %s WHERE id > %s AND id <= %s").format(schema)
    insert = sql.SQL("INSERT INTO {}.items (id, name, qty, balance, updated_at, prefs) SELECT g, 'new ' || g, 1, "
                     "g, now(), jsonb_build_object('new', true) FROM generate_series(%s, %s) g").format(schema)
    delete = sql.SQL("DELETE FROM {}.items WHERE id > %s AND id <= %s").format(schema)
    conn = source_connection(source.stack)
    conn.autocommit = False
    with conn.cursor() as cur:
        for mark in ("a", "b"):
            for first in range(0, rows, TRANSACTION_ROWS):
                cur.execute(update, (mark, first, first + TRANSACTION_ROWS))
                changes += cur.rowcount
                conn.commit()
        for first in range(rows, rows + rows // 5, TRANSACTION_ROWS):
            cur.execute(insert, (first + 1, min(first + TRANSACTION_ROWS, rows + rows // 5)))
            changes += cur.rowcount
            conn.commit()
        for first in range(0, rows // 5, TRANSACTION_ROWS):
            cur.execute(delete, (first, first + TRANSACTION_ROWS))
            changes += cur.rowcount
            conn.commit()
    conn.close()
    return changes


def one_run(stack: dict[str, str], args: argparse.Namespace, engine: str, tmp: Path) -> dict[str, Any]:
    hook = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)
    tmp.mkdir(parents=True)
    source = Source(stack, args.rows)
    source.fill()
    run: AppRun | None = None
    config: dict[str, Any] = {}
    try:
        source.create_connector(hook, args.partitions, **{"snapshot.mode": "no_data"})
        wait_until(f"{source.name} RUNNING", lambda: not hook.connector_problems(source.name), 120, 0.5)
        source.write_marker()  # the change topic exists once the connector has published a change
        wait_until("the change topic", lambda: topics_exist(stack["EOS_KAFKA_BOOTSTRAP"], [source.topic]), 120, 0.2)
        hook.pause_connector(source.name)
        time.sleep(3)  # the task stops polling; what follows waits in the slot
        changes = _change_source(source)
        offsets = StableOffsets(stack["EOS_KAFKA_BOOTSTRAP"], source.topic)
        offsets.start()
        resumed = time.time()
        hook.resume_connector(source.name)
        wait_until("Debezium's backlog published", offsets.settled, 1800, 1)
        published, end = offsets.published_at(), offsets.total()
        launched = time.time()
        run, config = start_mirror(stack, source, engine, args.batch, tmp)
        committed = batch_committed_at(run, "the mirror at the topic's end", lambda b, _: end_offsets_sum(b) >= end)
        events = verify_mirror(stack, source, run, config)
    finally:
        finish_run(stack, hook, source, run, config)
    first = min(e["started_at"] for e in events)
    seconds = {"debezium": published - resumed, "mirror_batches": committed - first,
               "mirror_launch": committed - launched}
    return {"changes": changes, **{f"{name}_seconds": round(value, 2) for name, value in seconds.items()},
            **{name: round(changes / value) for name, value in seconds.items()}, "batches": len(events),
            "load_average": load_average()}


def main() -> None:
    args = engine_arguments(__doc__ or "", 100_000, "cdc_publish_rate.json")
    report = run_engines(args, one_run, FIGURES)
    medians = report["medians"]
    report["mirror_over_debezium"] = {engine: {clock: round(m[f"mirror_{clock}"] / m["debezium"], 2)
                                               for clock in ("batches", "launch")} for engine, m in medians.items()}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'changes/s':<12}" + "".join(f"{name:>16}" for name in FIGURES))
    for engine, figures in medians.items():
        print(f"{engine:<12}" + "".join(f"{figures[name]:>16,.0f}" for name in FIGURES))


if __name__ == "__main__":
    main()
