"""Visibility latency of a change stream on the continuous engine, with whole source transactions
and per key: from a source transaction's commit to every one of its changes visible in the mirror.

    .venv/bin/python bench/cdc_latency.py --rate 2000 --runs 3

Method. A writer commits one source transaction every ``--interval`` seconds (50 ms), each
updating one block of ``--rate`` times ``--interval`` rows (100 at 2,000 changes/s) of a table of ten
blocks, setting their ``tick`` to the transaction's number: block ``tick mod 10``. Debezium's
PostgreSQL connector on the stack's Kafka Connect worker (``postgres_connector_config``, as the
demo and the tests create it) publishes the changes and the transaction topic; the pipeline
mirrors the table on the continuous engine (``exactly_once``, its defaults), with
``transactions: whole`` (reading the transaction topic) or ``per_key``. A watcher polls every
20 ms the mirror's least ``tick`` per block: transaction T is wholly visible once its block's
least tick is at least T (a later transaction of the block sets a larger tick, so this stays
true). A transaction's latency is from its ``commit`` returning to the first poll that sees it
whole; the writer and the watcher are threads of this process, one clock (``time.monotonic``).
Only transactions committed in the measured window count. The latency includes Debezium's
(WAL to Kafka, its transactions' commits on the Connect worker): ``whole`` minus ``per_key`` is
what whole transactions add. Each run is a fresh source schema, connector, slot and pipeline;
runs alternate (``bench.common.in_turn``); a figure is the median of the runs' p50, p90, p99
and max. Each run ends by comparing the mirror with its source: no figure for a wrong mirror.

Writes ``--out`` (bench/results/cdc_latency.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2 import sql

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook  # noqa: E402
from airflow_provider_eos.utils.debezium_config import postgres_connector_config  # noqa: E402
from bench.common import CONNECT_CONN, connect_stack, git_commit, in_turn, load_average, machine  # noqa: E402
from bench.harness import (  # noqa: E402
    AppRun,
    drop_cdc_source,
    pg_connect,
    pipeline_config,
    source_connection,
    start_continuous,
    topics_exist,
    wait_until,
)

BLOCKS = 10
FIGURES = ("p50", "p90", "p99", "max")


@dataclass
class Probe:
    """The writer's commits and the watcher's first sightings, by transaction number."""

    committed: dict[int, float] = field(default_factory=dict)
    seen: dict[int, float] = field(default_factory=dict)
    error: BaseException | None = None

    def latencies_ms(self, window: tuple[float, float]) -> list[float]:
        return sorted((self.seen[t] - at) * 1000 for t, at in self.committed.items()
                      if window[0] <= at < window[1] and t in self.seen)


def _write(conn: Any, schema: str, rows_per_block: int, interval: float, stop: threading.Event,
           probe: Probe) -> None:
    """One transaction per ``interval``: the block of ``tick mod BLOCKS`` set to ``tick``."""
    update = sql.SQL("UPDATE {}.items SET tick = %s WHERE id >= %s AND id < %s").format(sql.Identifier(schema))
    tick, started = 1, time.monotonic()
    try:
        conn.autocommit = False
        while not stop.is_set():
            first = (tick % BLOCKS) * rows_per_block
            with conn.cursor() as cur:
                cur.execute(update, (tick, first, first + rows_per_block))
            conn.commit()
            probe.committed[tick] = time.monotonic()
            tick += 1
            time.sleep(max(0.0, started + tick * interval - time.monotonic()))
    except BaseException as exc:
        probe.error = exc


def _watch(conn: Any, target_schema: str, rows_per_block: int, stop: threading.Event, probe: Probe) -> None:
    """Every 20 ms, the least tick of each block; each transaction newly whole is stamped."""
    query = sql.SQL("SELECT id / %s, min(tick) FROM {}.items GROUP BY 1").format(sql.Identifier(target_schema))
    waiting_for = {block: block or BLOCKS for block in range(BLOCKS)}  # each block's next transaction
    try:
        while not stop.is_set():
            try:
                with conn.cursor() as cur:
                    cur.execute(query, (rows_per_block,))
                    least = dict(cur.fetchall())
            except psycopg2.errors.UndefinedTable:  # before the first cycle created the target
                time.sleep(0.02)
                continue
            now = time.monotonic()
            for block, tick in least.items():
                while waiting_for[block] <= tick:
                    probe.seen[waiting_for[block]] = now
                    waiting_for[block] += BLOCKS
            time.sleep(0.02)
    except BaseException as exc:
        probe.error = exc


@dataclass
class Source:
    """A run's source schema, its connector and slot."""

    stack: dict[str, str]
    rows_per_block: int
    name: str = field(default_factory=lambda: f"lat_{uuid.uuid4().hex[:10]}")

    @property
    def topics(self) -> dict[str, str]:
        return {"items": f"{self.name}.{self.name}.items", "transaction": f"{self.name}.transaction"}

    def create(self, hook: KafkaConnectHook, connector_extra: dict[str, Any]) -> None:
        conn = source_connection(self.stack)
        with conn.cursor() as cur:
            schema = sql.Identifier(self.name)
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(schema))
            cur.execute(sql.SQL("CREATE TABLE {}.items (id bigint PRIMARY KEY, tick bigint NOT NULL)").format(schema))
            cur.execute(sql.SQL("INSERT INTO {}.items SELECT g, 0 FROM generate_series(0, %s) g").format(schema),
                        (BLOCKS * self.rows_per_block - 1,))
        conn.close()
        hook.put_connector_config(self.name, postgres_connector_config(
            self.stack, self.name, f"dbz_{self.name[4:]}", [f"{self.name}.items"], **connector_extra))
        wait_until(f"{self.name} RUNNING", lambda: not hook.connector_problems(self.name), 120, 0.5)

    def drop(self, hook: KafkaConnectHook) -> None:
        drop_cdc_source(self.stack, hook, self.name, f"dbz_{self.name[4:]}", self.name)


def _mirror(source: Source, transactions: str) -> dict[str, Any]:
    return {"topic_prefix": source.name, "transactions": transactions, "tables": [
        {"source": f"{source.name}.items", "key": ["id"], "columns": {"id": "bigint", "tick": "bigint"}}]}


def _differences(source: Source, target: Any, target_schema: str) -> int:
    conn = source_connection(source.stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT id, tick FROM {}.items").format(sql.Identifier(source.name)))
        expected = set(cur.fetchall())
    conn.close()
    with target.cursor() as cur:
        cur.execute(sql.SQL("SELECT id, tick FROM {}.items").format(sql.Identifier(target_schema)))
        return len(expected ^ set(cur.fetchall()))


def one_run(stack: dict[str, str], args: argparse.Namespace, transactions: str, tmp: Path) -> dict[str, Any]:
    """A fresh source, connector and pipeline; the writer and the watcher through the warm-up and
    the measured window; the mirror compared with its source once the writer stopped."""
    hook = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)
    tmp.mkdir(parents=True)
    source = Source(stack, round(args.rate * args.interval))
    source.create(hook, {"poll.interval.ms": args.poll_interval_ms} if args.poll_interval_ms else {})
    topics = [source.topics["items"]] + ([source.topics["transaction"]] if transactions == "whole" else [])
    config = pipeline_config(stack, tmp, source.name[4:], topics=topics, spec=None, engine="continuous",
                             trigger="processingTime", mirror=_mirror(source, transactions))
    probe, stop_writer, stop_watcher = Probe(), threading.Event(), threading.Event()
    target, writer_conn = pg_connect(stack), source_connection(stack)
    target.autocommit = True
    run: AppRun | None = None
    threads = [threading.Thread(target=_write, args=(writer_conn, source.name, source.rows_per_block,
                                                     args.interval, stop_writer, probe), daemon=True),
               threading.Thread(target=_watch, args=(target, config["target_schema"], source.rows_per_block,
                                                     stop_watcher, probe), daemon=True)]
    try:
        for thread in threads:
            thread.start()
        # The transaction topic is created by the connector's first source transaction.
        wait_until("the change and transaction topics",
                   lambda: topics_exist(stack["EOS_KAFKA_BOOTSTRAP"], list(source.topics.values())), 120, 0.5)
        run = start_continuous(config, tmp, label=transactions)
        started = time.monotonic()
        window = (started + args.warmup, started + args.warmup + args.measure)
        time.sleep(args.warmup + args.measure)
        stop_writer.set()
        last = max(probe.committed)
        wait_until("the last transaction visible", lambda: last in probe.seen or run.process.poll() is not None,
                   120, 0.5)
        assert run.process.poll() is None and probe.error is None, (probe.error, run.log()[-3000:])
        stop_watcher.set()
        differ = _differences(source, target, config["target_schema"])
        assert differ == 0, f"the mirror differs from its source in {differ} rows: no figure for it"
    finally:
        stop_writer.set()
        stop_watcher.set()
        if run is not None:
            run.kill()
        for conn in (target, writer_conn):
            conn.close()
        source.drop(hook)
    latencies = probe.latencies_ms(window)
    cycles = run.events("batch")
    return {"transactions": len(latencies), "cycles": len(cycles), "load_average": load_average(),
            **{name: round(value, 1) for name, value in _figures(latencies).items()}}


def _figures(latencies: list[float]) -> dict[str, float]:
    def at(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": latencies[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=2000, help="source changes per second")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between source transactions")
    parser.add_argument("--warmup", type=float, default=10)
    parser.add_argument("--measure", type=float, default=30)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--poll-interval-ms", type=int,
                        help="the connector's poll.interval.ms (Debezium's default: 500)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cdc_latency.json"))
    args = parser.parse_args()
    stack = connect_stack()
    runs: dict[str, list[dict[str, Any]]] = {"whole": [], "per_key": []}
    with tempfile.TemporaryDirectory(prefix="eos-bench-cdc-latency-") as tmp:
        for index, transactions in in_turn(list(runs), args.runs):
            result = one_run(stack, args, transactions, Path(tmp) / f"{transactions}-{index}")
            print(json.dumps({"transactions": transactions, "run": index, **result}), flush=True)
            runs[transactions].append(result)
    medians = {t: {name: statistics.median(r[name] for r in rs) for name in FIGURES} for t, rs in runs.items()}
    report = {"command": "bench/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "code": git_commit(ROOT),
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
              "connector_poll_interval_ms": args.poll_interval_ms or "Debezium's default (500)",
              "rate": args.rate, "interval": args.interval, "warmup": args.warmup, "measure": args.measure,
              "runs": runs, "medians_ms": medians,
              "added_by_whole_ms": {name: round(medians["whole"][name] - medians["per_key"][name], 1)
                                    for name in FIGURES}}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'transactions':<14}" + "".join(f"{name:>9}" for name in FIGURES))
    for transactions, figures in medians.items():
        print(f"{transactions:<14}" + "".join(f"{figures[name]:>7.0f}ms" for name in FIGURES))


if __name__ == "__main__":
    main()
