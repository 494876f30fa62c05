"""A first snapshot, timed: a source table of ``--rows`` rows captured by Debezium's PostgreSQL
connector with ``snapshot.mode=initial``, mirrored by this project's pipeline on each engine.
What a user waits for when a mirror is first switched on.

    .venv/bin/python bench/cdc_snapshot.py --rows 1000000 --runs 3

Method. Each run makes a fresh source schema with one table ``items`` of ``--rows`` rows in the
stack's source database (the columns of ``bench/cdc_changes.COLUMNS``: ``bigint`` key, ``text``,
``integer``, ``numeric(20,6)``, ``timestamptz``, ``jsonb``), then a fresh connector
(``postgres_connector_config``: JSON with schemas, the stack's Connect worker, exactly-once
source, ``--partitions`` partitions per change topic), slot and pipeline. The clock starts when
Connect's REST API has accepted the connector. The mirror is launched as soon as the change
topic exists, as a stream DAG already running would read it: ``exactly_once``, Spark
``local[2]`` with ``processingTime`` (``bench/harness.spark_submit``) or the continuous engine,
``max_offsets_per_trigger`` = ``--batch``. Figures, all ``time.time()`` of this machine:

* ``debezium_s``: until the change topic's last stable offset (Kafka ``read_committed``, polled
  every 0.25 s) reached its final value: Debezium's time to publish the snapshot;
* ``mirror_s``: until the batch that brought the rows it applied to ``--rows`` committed: the
  time from the connector's creation to the mirror holding the whole table;
* ``mirror_after_debezium_s``: the difference, how long the mirror trails the publisher.

Each run then compares the mirror with its source: count and an md5 over every row's text,
ordered by key, in both databases; a run whose mirror differs stops the bench. Engines alternate
(``bench.common.in_turn``); a figure is the median of the runs.

Writes ``--out`` (bench/results/cdc_snapshot.json) and prints a table.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psycopg2 import sql

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook  # noqa: E402
from airflow_provider_eos.utils.debezium_config import postgres_connector_config  # noqa: E402
from bench.cdc_changes import COLUMNS  # noqa: E402
from bench.common import CONNECT_CONN, connect_stack, drop_schemas, git_commit, in_turn, load_average, machine  # noqa: E402
from bench.harness import (  # noqa: E402
    AppRun,
    drop_cdc_source,
    pg_connect,
    pipeline_config,
    source_connection,
    start_app,
    start_continuous,
    topics_exist,
    wait_until,
)

ENGINES = ("spark", "continuous")
FIGURES = ("debezium_s", "mirror_s", "mirror_after_debezium_s")
# The rows, made by PostgreSQL itself: every column of COLUMNS filled, a jsonb of a few keys.
FILL = """INSERT INTO {}.items (id, name, qty, balance, updated_at, prefs)
SELECT g, 'customer ' || md5(g::text), (g %% 1000)::integer, (g * 1.25)::numeric(20,6),
       timestamptz '2026-11-27 00:00:00+00' + g * interval '1 second',
       jsonb_build_object('tier', g %% 5, 'tags', jsonb_build_array('a', 'b'), 'note', md5((g * 7)::text))
FROM generate_series(1, %s) g"""
# Both databases print a row's columns the same way (same server, same types): one digest each.
DIGEST = "SELECT count(*), md5(string_agg(t::text, E'\\n' ORDER BY t.id)) FROM (SELECT {} FROM {}.items) t"


@dataclass
class Source:
    """A run's source schema, its connector and slot."""

    stack: dict[str, str]
    rows: int
    name: str = field(default_factory=lambda: f"snap_{uuid.uuid4().hex[:10]}")

    @property
    def topic(self) -> str:
        return f"{self.name}.{self.name}.items"

    def fill(self) -> None:
        conn = source_connection(self.stack)
        with conn.cursor() as cur:
            schema = sql.Identifier(self.name)
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(schema))
            cur.execute(sql.SQL("CREATE TABLE {}.items (id bigint PRIMARY KEY, name text NOT NULL, qty integer, "
                                "balance numeric(20,6), updated_at timestamptz, prefs jsonb)").format(schema))
            cur.execute(sql.SQL(FILL).format(schema), (self.rows,))
            cur.execute(sql.SQL("VACUUM ANALYZE {}.items").format(schema))
        conn.close()

    def create_connector(self, hook: KafkaConnectHook, partitions: int, **extra: Any) -> float:
        """The connector's creation, accepted by Connect: the run's clock starts here."""
        hook.put_connector_config(self.name, postgres_connector_config(
            self.stack, self.name, f"dbz_{self.name[5:]}", [f"{self.name}.items"],
            **{"topic.creation.default.partitions": partitions, **extra}))
        return time.time()

    def write_marker(self) -> None:
        """One change (row 1's qty set to itself): a connector that takes no snapshot creates
        its change topic with its first change."""
        conn = source_connection(self.stack)
        with conn.cursor() as cur:
            cur.execute(sql.SQL("UPDATE {}.items SET qty = qty WHERE id = 1").format(sql.Identifier(self.name)))
        conn.close()

    def drop(self, hook: KafkaConnectHook) -> None:
        drop_cdc_source(self.stack, hook, self.name, f"dbz_{self.name[5:]}", self.name)


class StableOffsets:
    """A thread sampling the sum of a topic's last stable offsets every 0.25 s."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka.admin import AdminClient

        self.admin, self.topic = AdminClient({"bootstrap.servers": bootstrap}), topic
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def total(self) -> int:
        from confluent_kafka import IsolationLevel, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        partitions = self.admin.list_topics(self.topic, timeout=10).topics[self.topic].partitions
        asked = {TopicPartition(self.topic, p): OffsetSpec.latest() for p in partitions}
        futures = self.admin.list_offsets(asked, isolation_level=IsolationLevel.READ_COMMITTED)
        return sum(future.result(10).offset for future in futures.values())

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.total()))
            self._stop.wait(0.25)

    def start(self) -> None:
        self._thread.start()

    def settled(self) -> bool:
        """Whether the offsets grew since the first sample and then stayed put for 3 s."""
        samples = list(self.samples)
        if not samples or samples[-1][1] <= samples[0][1]:
            return False
        last_change = max(at for at, total in samples if total < samples[-1][1])
        return time.time() - last_change >= 3

    def published_at(self) -> float:
        """When the offsets first reached their final value (read now, after the mirror's end)."""
        self._stop.set()
        self._thread.join(10)
        final = self.total()
        return next(at for at, total in self.samples if total >= final)


def start_mirror(stack: dict[str, str], source: Source, engine: str, batch: int, tmp: Path) -> tuple[AppRun, dict]:
    mirror = {"topic_prefix": source.name, "tables": [
        {"source": f"{source.name}.items", "key": ["id"], "columns": dict(COLUMNS)}]}
    config = pipeline_config(stack, tmp, source.name[5:], topics=[source.topic], spec=None, mirror=mirror,
                             trigger="processingTime", max_offsets_per_trigger=batch)
    run = start_app(config, tmp, label=engine) if engine == "spark" else start_continuous(config, tmp, label=engine)
    return run, config


def batch_committed_at(run: AppRun, what: str, reached: Callable[[dict[str, Any], int], bool],
                       timeout: float = 1800) -> float:
    """The commit time of the mirror's first batch for which ``reached(batch, rows applied up to
    it)`` holds, waited for; the bench stops if the mirror ends first."""
    def found() -> float | None:
        if run.process.poll() is not None:
            raise SystemExit(f"the mirror ended ({run.process.returncode}):\n{run.log()[-3000:]}")
        applied = 0
        for event in run.events("batch"):
            applied += event["applied"]
            if reached(event, applied):
                return float(event["committed_at"])
        return None

    return wait_until(what, found, timeout, 0.5)


def _digest(conn: Any, schema: str) -> tuple[int, str]:
    columns = sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
    with conn.cursor() as cur:
        cur.execute(sql.SQL(DIGEST).format(columns, sql.Identifier(schema)))
        count, digest = cur.fetchone()
    return count, digest


def check_equal(stack: dict[str, str], source: Source, target_schema: str) -> None:
    source_conn, target_conn = source_connection(stack), pg_connect(stack)
    try:
        expected, found = _digest(source_conn, source.name), _digest(target_conn, target_schema)
    finally:
        source_conn.close()
        target_conn.close()
    if expected != found:
        raise SystemExit(f"the mirror differs from its source (rows, md5): {found} != {expected}: no figure for it")


def verify_mirror(stack: dict[str, str], source: Source, run: AppRun, config: dict[str, Any]) -> list[dict]:
    """Stops the mirror and checks it: no dead letter, equal to its source. Returns its batches."""
    run.kill()
    events = run.events("batch")
    if any(e["dead_lettered"] for e in events):
        raise SystemExit(f"the mirror dead-lettered records: {[e['dead_lettered'] for e in events]}")
    check_equal(stack, source, config["target_schema"])
    return events


def finish_run(stack: dict[str, str], hook: KafkaConnectHook, source: Source, run: AppRun | None,
               config: dict[str, Any]) -> None:
    """A run's end, whatever happened: its mirror killed, its connector, slot and source dropped,
    then its target and bookkeeping schemas."""
    if run is not None:
        run.kill()
    source.drop(hook)
    if config:
        conn = pg_connect(stack)
        drop_schemas(conn, config["target_schema"], config["meta_schema"])
        conn.close()


def one_run(stack: dict[str, str], args: argparse.Namespace, engine: str, tmp: Path) -> dict[str, Any]:
    """A fresh source, connector and pipeline; the clocks from the connector's creation."""
    hook = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)
    tmp.mkdir(parents=True)
    source = Source(stack, args.rows)
    source.fill()
    run: AppRun | None = None
    config: dict[str, Any] = {}
    try:
        created = source.create_connector(hook, args.partitions)
        wait_until("the change topic", lambda: topics_exist(stack["EOS_KAFKA_BOOTSTRAP"], [source.topic]), 300, 0.1)
        offsets = StableOffsets(stack["EOS_KAFKA_BOOTSTRAP"], source.topic)
        offsets.start()
        launched = time.time()
        run, config = start_mirror(stack, source, engine, args.batch, tmp)
        # A snapshot's every record is one row's insert.
        mirrored = batch_committed_at(run, "the whole table mirrored", lambda _, applied: applied >= args.rows)
        published = offsets.published_at()
        events = verify_mirror(stack, source, run, config)
    finally:
        finish_run(stack, hook, source, run, config)
    return {"debezium_s": round(published - created, 2), "mirror_s": round(mirrored - created, 2),
            "mirror_after_debezium_s": round(mirrored - published, 2),
            "mirror_launched_s": round(launched - created, 2),
            "first_batch_s": round(min(e["started_at"] for e in events) - created, 2),
            "batches": len(events), "load_average": load_average()}


def engine_arguments(description: str, rows: int, out: str) -> argparse.Namespace:
    """The options of the benches that run each engine from a fresh source and connector."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=rows, help="rows of the source table")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=50_000, help="max_offsets_per_trigger (records)")
    parser.add_argument("--partitions", type=int, default=2, help="partitions of the change topic")
    parser.add_argument("--engines", default=",".join(ENGINES), type=lambda text: text.split(","))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / out))
    return parser.parse_args()


def run_engines(args: argparse.Namespace, one_run: Any, figures: tuple[str, ...]) -> dict[str, Any]:
    """``args.runs`` runs of ``one_run`` per engine, alternating; the report's common part, with
    each figure's median per engine (``medians``)."""
    stack = connect_stack()
    runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in args.engines}
    with tempfile.TemporaryDirectory(prefix="eos-bench-cdc-") as tmp:
        for index, engine in in_turn(list(runs), args.runs):
            result = one_run(stack, args, engine, Path(tmp) / f"{engine}-{index}")
            print(json.dumps({"engine": engine, "run": index, **result}), flush=True)
            runs[engine].append(result)
    return {"command": "bench/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "code": git_commit(ROOT),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
            "rows": args.rows, "batch": args.batch, "partitions": args.partitions, "runs": runs,
            "medians": {engine: {name: statistics.median(r[name] for r in rs) for name in figures}
                        for engine, rs in runs.items()}}


def main() -> None:
    args = engine_arguments(__doc__ or "", 1_000_000, "cdc_snapshot.json")
    report = run_engines(args, one_run, FIGURES)
    medians = report["medians"]
    report["rows_per_second"] = {engine: {"debezium": round(args.rows / m["debezium_s"]),
                                          "mirror": round(args.rows / m["mirror_s"])} for engine, m in medians.items()}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'engine':<12}" + "".join(f"{name:>26}" for name in FIGURES))
    for engine, figures in medians.items():
        print(f"{engine:<12}" + "".join(f"{figures[name]:>25.1f}s" for name in FIGURES))


if __name__ == "__main__":
    main()
