"""What issue 25's item 3 would save: each task COPYs straight into the target inside a prepared
transaction, against today's stage-then-apply, measured on PostgreSQL alone.

    .venv/bin/python bench/prepared_copy.py --rows 100000 --tasks 2 --runs 5

One ledger batch (events + balances), split over ``--tasks`` threads, each with its own
connection as an executor task has:

* ``stage_apply`` (what ``exactly_once`` does today): each task COPYs its COPY-text lines
  into the batch's UNLOGGED stage (``staging.create_stage``, fields as text) and commits;
  then one transaction runs ``apply_sql.apply_batch_statement`` (the casts, the events rows,
  the balances' upsert, dead letters) and advances the offsets (``OffsetsStore.advance``).
* ``prepared_copy`` (item 3's shape): each task COPYs typed lines straight into the events
  table and ``PREPARE TRANSACTION``s; then one transaction upserts the batch's per-key
  balance deltas and advances the offsets, and after its COMMIT each task's transaction is
  ``COMMIT PREPARED``.

Left out of the clock on both sides: encoding the lines, and for ``prepared_copy`` summing
the per-key deltas (Spark would do it, on its cores) and what it gives up: a value PostgreSQL
refuses fails a task's whole COPY (no per-record verdict without a fallback), and a reader
sees the events rows of a batch appear task by task after its decision commits. Rounds
alternate in a shuffled order, the tables emptied before each; medians over ``--runs``.
PostgreSQL only, no Spark or Kafka: the database's share of a batch, not a pipeline's rate.

Writes bench/results/prepared_copy.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2 import sql
from psycopg2.extras import execute_values

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import ROOT, drop_schemas, fresh_ledger_schemas, load_average, local_stack, machine
from spark_apps.eos_stream.records.parsing import parse_record, staging_columns, staging_lines
from spark_apps.eos_stream.sink import apply_sql
from spark_apps.eos_stream.sink.offsets_store import OffsetsStore
from spark_apps.eos_stream.sink.staging import copy_from_chunks, create_stage
from spark_apps.eos_stream.state import meta_tables
from spark_apps.ledger.generator import _event
from spark_apps.ledger.spec import BALANCES_TABLE, EVENTS_TABLE, LEDGER

META, TARGET, PIPELINE, TOPIC = "m_bench_prepared", "t_bench_prepared", "bench_prepared", "bench"
EVENT_COLUMNS = ["kafka_topic", "kafka_partition", "kafka_offset", *(f.name for f in LEDGER.fields)]


def _in_parallel(work: list[Callable[[], None]]) -> None:
    """Runs each job in a thread of its own, as the executors' tasks run; re-raises a job's error."""
    with ThreadPoolExecutor(len(work)) as pool:
        for future in [pool.submit(job) for job in work]:
            future.result()


class Batch:
    """One batch's records, its tasks' slices, and everything encoded ahead of the clock."""

    def __init__(self, rows: int, tasks: int) -> None:
        rng, start = random.Random(1), datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
        records = [(TOPIC, i % 4, i // 4, None, _event(rng, i, 200, start)[1]) for i in range(rows)]
        # A task per group of partitions, as Spark's Kafka source gives one per partition.
        slices = [[r for r in records if r[1] % tasks == task] for task in range(tasks)]
        self.stage_lines = ["".join(staging_lines(LEDGER, part, False)).encode() for part in slices]
        self.typed_lines = []
        deltas: dict[str, list[int]] = defaultdict(lambda: [0, 0, -1, -1, 0])  # sum, count, partition, offset, seq
        for part in slices:
            lines = []
            for topic, partition, offset, _key, value in part:
                event = parse_record(LEDGER, value)
                lines.append("\t".join(str(v) for v in (topic, partition, offset, *event.values())) + "\n")
                delta = deltas[event["account_id"]]
                delta[0] += event["amount_cents"]
                delta[1] += 1
                if (partition, offset) > (delta[2], delta[3]):
                    delta[2], delta[3], delta[4] = partition, offset, event["seq"]
            self.typed_lines.append("".join(lines).encode())
        self.deltas = [(account, d[0], d[1], d[4]) for account, d in sorted(deltas.items())]
        ends: dict[tuple[str, int], int] = {}
        for topic, partition, offset, _key, _value in records:
            ends[(topic, partition)] = max(ends.get((topic, partition), 0), offset + 1)
        self.ends = ends


def _connect(stack: dict[str, str]) -> Any:
    return psycopg2.connect(host=stack["EOS_PG_HOST"], port=stack["EOS_PG_PORT"], dbname=stack["EOS_PG_DB"],
                            user=stack["EOS_PG_USER"], password=stack["EOS_PG_PASSWORD"])


def stage_apply(driver: Any, tasks: list[Any], batch: Batch, batch_id: int) -> dict[str, float]:
    """Today's exactly_once: stage in parallel, then one apply transaction."""
    stage = create_stage(driver, LEDGER, META, f"stage_{batch_id}")
    began = time.perf_counter()

    def copy(conn: Any, data: bytes) -> Callable[[], None]:
        def job() -> None:
            with conn.cursor() as cur:
                copy_from_chunks(cur, stage, staging_columns(LEDGER), iter([data]))
            conn.commit()
        return job

    _in_parallel([copy(conn, data) for conn, data in zip(tasks, batch.stage_lines, strict=True)])
    staged = time.perf_counter()
    statement = apply_sql.apply_batch_statement(LEDGER, stage=stage, target_schema=TARGET, meta_schema=META,
                                                skip_applied=True, dedupe=True, upsert_rows=False)
    with driver.cursor() as cur:
        cur.execute(statement, {"pipeline": PIPELINE})
        cur.fetchone()
        OffsetsStore(META, PIPELINE).advance(cur, batch.ends, batch_id)
    driver.commit()
    done = time.perf_counter()
    with driver.cursor() as cur:
        cur.execute(sql.SQL("DROP TABLE {}").format(stage))
    driver.commit()
    return {"tasks": staged - began, "driver": done - staged, "total": done - began}


def prepared_copy(driver: Any, tasks: list[Any], batch: Batch, batch_id: int) -> dict[str, float]:
    """Item 3's shape: each task writes its rows once, prepared; the driver's transaction decides."""
    events = sql.SQL("{}.{}").format(sql.Identifier(TARGET), sql.Identifier(EVENTS_TABLE))
    gids = [f"eos-bench-{batch_id}-{task}-{uuid.uuid4().hex[:8]}" for task in range(len(tasks))]
    began = time.perf_counter()

    def copy(conn: Any, data: bytes, gid: str) -> Callable[[], None]:
        def job() -> None:
            conn.tpc_begin(gid)  # as the two_phase sink does
            with conn.cursor() as cur:
                copy_from_chunks(cur, events, EVENT_COLUMNS, iter([data]))
            conn.tpc_prepare()  # the COMMIT PREPARED comes after the driver's decision
        return job

    _in_parallel([copy(conn, data, gid) for conn, data, gid in zip(tasks, batch.typed_lines, gids, strict=True)])
    prepared = time.perf_counter()
    balances = sql.SQL("{}.{}").format(sql.Identifier(TARGET), sql.Identifier(BALANCES_TABLE))
    with driver.cursor() as cur:
        execute_values(cur, sql.SQL(
            "INSERT INTO {b} (account_id, balance_cents, event_count, last_seq) VALUES %s"
            " ON CONFLICT (account_id) DO UPDATE SET balance_cents = {b}.balance_cents + EXCLUDED.balance_cents,"
            " event_count = {b}.event_count + EXCLUDED.event_count, last_seq = EXCLUDED.last_seq").format(
            b=balances).as_string(cur), batch.deltas, page_size=len(batch.deltas))
        OffsetsStore(META, PIPELINE).advance(cur, batch.ends, batch_id)
    driver.commit()
    decided = time.perf_counter()
    for conn in tasks:
        conn.tpc_commit()  # COMMIT PREPARED of the transaction this connection prepared
    done = time.perf_counter()
    return {"tasks": prepared - began, "driver": decided - prepared, "commit_prepared": done - decided,
            "total": done - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prepared_copy.json")
    args = parser.parse_args()
    stack = local_stack()
    load_at_start = load_average()
    batch = Batch(args.rows, args.tasks)
    driver = _connect(stack)
    tasks = [_connect(stack) for _ in range(args.tasks)]
    fresh_ledger_schemas(driver, META, TARGET)
    paths = {"stage_apply": stage_apply, "prepared_copy": prepared_copy}
    timings: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    try:
        for run in range(args.runs):
            for name in random.Random(run).sample(sorted(paths), len(paths)):
                with driver.cursor() as cur:  # each round starts from empty targets and no offsets
                    cur.execute(sql.SQL("TRUNCATE {}.{}, {}.{}, {}").format(
                        sql.Identifier(TARGET), sql.Identifier(EVENTS_TABLE), sql.Identifier(TARGET),
                        sql.Identifier(BALANCES_TABLE), meta_tables.table(META, meta_tables.OFFSETS)))
                driver.commit()
                timings[name].append(paths[name](driver, tasks, batch, run))
                with driver.cursor() as cur:
                    cur.execute(sql.SQL("SELECT count(*) FROM {}.{}").format(
                        sql.Identifier(TARGET), sql.Identifier(EVENTS_TABLE)))
                    rows = (cur.fetchone() or (0,))[0]
                driver.commit()
                if rows != args.rows:
                    raise AssertionError(f"{name}: {rows} events rows after a batch of {args.rows}")
    finally:
        drop_schemas(driver, META, TARGET)
        for conn in (driver, *tasks):
            conn.close()
    medians = {name: {phase: round(statistics.median(r[phase] for r in runs) * 1000, 1) for phase in runs[0]}
               for name, runs in timings.items()}
    result = {
        "command": f"bench/prepared_copy.py --rows {args.rows} --tasks {args.tasks} --runs {args.runs}",
        "machine": machine(), "load_average_at_start": load_at_start, "load_average_at_end": load_average(),
        "rows": args.rows, "tasks": args.tasks, "runs": args.runs, "accounts": len(batch.deltas),
        "medians_ms": medians,
        "runs_ms": {name: [{k: round(v * 1000, 1) for k, v in r.items()} for r in runs]
                    for name, runs in timings.items()},
        "prepared_over_stage_apply": round(medians["prepared_copy"]["total"] / medians["stage_apply"]["total"], 3),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("medians_ms", "prepared_over_stage_apply")}, indent=2))


if __name__ == "__main__":
    main()
