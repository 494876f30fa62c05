"""Changes per second applied to a mirror, from the same Debezium change topics: this
project's mirror pipeline against the ``foreachBatch`` mirror a Spark user would write.

    .venv/bin/python bench/cdc_throughput.py --changes 300000 --tables 1 20 --runs 3
    .venv/bin/python bench/cdc_throughput.py --figures mirror,mirror_continuous --baseline /tmp/before

The change topics are made once per table count, fast and reproducibly
(``bench/cdc_changes.py``): Debezium's PostgreSQL records (JSON converter, ``--schemas`` on
or off), keyed by primary key, partitioned as Connect's producer does, committed by a
transactional producer in transactions of 5,000; creates, updates (many keys change several
times within a batch) and deletes (each with its tombstone), the same total over 1 table or
over 20. Every figure reads the same topics with ``availableNow``, ``maxOffsetsPerTrigger`` =
``--batch``, spark-submit ``local[2]`` with the same settings (``bench/harness.spark_submit``):

* ``mirror``: this project's mirror pipeline, ``exactly_once``, from its declarative
  definition (the config's ``mirror`` section, docs/cdc.md), one driver for every table;
* ``mirror_continuous``: the same definition on the continuous engine (one Python process, no
  Spark; ``max_offsets_per_trigger`` bounds its cycles), stopped once its batches hold every record;
* ``mirror_whole``: the same with ``transactions: whole``, reading the transaction topic too
  (asking for it makes the stream carry Debezium's transaction metadata for every figure: each
  change's ``transaction`` block, and a BEGIN and an END per source transaction);
* ``mirror_continuous_whole``: the continuous engine with ``transactions: whole``;
* ``peer_values``, ``peer_copy``: Structured Streaming ``foreachBatch``, at-least-once, with
  its best settings (``bench/cdc_peer.py`` says which and why): ``INSERT ... ON CONFLICT DO
  UPDATE`` by ``execute_values``, or COPY into a temporary table and one merge per table.
* ``peer_jdbc``: Debezium's JDBC sink connector in the stack's Connect worker (``--schemas``
  only; the worker is started if it is down), at-least-once, at its best settings
  (``bench/cdc_jdbc_peer.py``), timed until its target equals the stream's final state.

Runs alternate (``bench.common.in_turn``), each into a fresh target schema. Two clocks, both
``time.time()`` of this machine: **launch** (spark-submit started, to the last batch's commit:
what a user waits for) and **batches** (the first batch's start to the last batch's commit:
the JVM's and the session's start left out); and the machine's **busy CPU seconds** within the
batches' window (``bench.cpu_share.MachineBusy``: every process's, the stack's included). A
figure is a rate of changes (tombstones not counted) over a clock; each run's target is
compared with the stream's final rows first, and a run whose target differs stops the bench: no
speed is reported for a wrong mirror. With a ``_whole`` figure and its ``per_key`` one,
``whole_cost`` gives what whole transactions cost on each clock, also as the median of each
round's own cost.

Writes bench/results/cdc_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from psycopg2 import sql  # noqa: E402

from bench.cdc_changes import COLUMNS, ChangeStream  # noqa: E402
from bench.cdc_jdbc_peer import BATCH as JDBC_BATCH  # noqa: E402
from bench.cdc_jdbc_peer import create_tables, run_jdbc_peer  # noqa: E402
from bench.common import (  # noqa: E402
    connect_stack,
    drop_schemas,
    end_offsets_sum,
    git_commit,
    in_turn,
    load_average,
    local_stack,
    machine,
)
from bench.cpu_share import MachineBusy  # noqa: E402
from bench.harness import (  # noqa: E402
    continuous_until_read,
    pg_connect,
    pipeline_config,
    spark_submit,
    start_app,
    start_continuous,
)
from spark_apps.ledger.generator import ensure_topic  # noqa: E402

FIGURES = ("mirror", "mirror_whole", "mirror_continuous", "mirror_continuous_whole", "peer_values", "peer_copy",
           "peer_jdbc")
DEFAULT_FIGURES = FIGURES[:-1]  # peer_jdbc needs the Connect worker and --schemas
PEER = Path(__file__).with_name("cdc_peer.py")
TRANSACTION = 5000  # records per Kafka transaction
BASELINE = "@baseline"  # a figure's name for the same figure of the --baseline checkout


# --- the change topics -------------------------------------------------------

def produce(stack: dict[str, str], stream: ChangeStream, partitions: int) -> dict[str, int]:
    """Every record of ``stream`` into its table's topic, committed in transactions of
    TRANSACTION; keyed, partitioned by murmur2 of the key as Kafka Connect's producer does."""
    for topic in stream.topics():
        ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=partitions)
    if transaction_topic := stream.transaction_topic():
        ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], transaction_topic, partitions=1)  # as Debezium's
    producer = murmur2_producer(stack, f"cdc-bench-{stream.prefix}")
    records = 0
    producer.begin_transaction()
    for topic, key, value in stream.records():
        while True:
            try:
                producer.produce(topic, key=key, value=value)
                break
            except BufferError:
                producer.poll(0.1)
        records += 1
        if records % TRANSACTION == 0:
            producer.commit_transaction(60)
            producer.begin_transaction()
    producer.commit_transaction(60)
    return {"records": records, **stream.counts}


def murmur2_producer(stack: dict[str, str], transactional_id: str) -> Any:
    """A transactional producer that partitions as Kafka Connect's (Java's murmur2 of the key)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"], "transactional.id": transactional_id,
                         "linger.ms": 20, "compression.type": "lz4", "partitioner": "murmur2_random",
                         "queue.buffering.max.messages": 200_000})
    producer.init_transactions(30)
    return producer


def mirror_definition(stream: ChangeStream, transactions: str = "per_key") -> dict[str, Any]:
    return {"mirror": {"topic_prefix": stream.prefix, "transactions": transactions, "tables": [
        {"source": f"{stream.schema}.{table.name}", "key": ["id"], "columns": dict(COLUMNS)}
        for table in stream.tables]}}


# --- the oracle --------------------------------------------------------------

def differences(stack: dict[str, str], schema: str, expected: dict[str, dict[int, tuple]]) -> dict[str, int]:
    """Per table, the rows the target holds that the stream's final state lacks, plus the other way."""
    conn = pg_connect(stack)
    found = {}
    with conn.cursor() as cur:
        for table, rows in expected.items():
            cur.execute(sql.SQL("SELECT {} FROM {}.{}").format(sql.SQL(", ").join(map(sql.Identifier, COLUMNS)),
                                                               sql.Identifier(schema), sql.Identifier(table)))
            held = {row[0]: tuple(row) for row in cur.fetchall()}
            found[table] = (sum(1 for key, row in held.items() if rows.get(key) != row)
                            + sum(1 for key in rows if key not in held))
    conn.close()
    return found


def check_target(stack: dict[str, str], schema: str, expected: dict[str, dict[int, tuple]], figure: str) -> None:
    wrong = {table: n for table, n in differences(stack, schema, expected).items() if n}
    if wrong:
        raise SystemExit(f"{figure}: the target differs from the change stream's final state, rows per table "
                         f"{wrong}: no speed is reported for a wrong mirror")


# --- one run of each figure --------------------------------------------------

def _clocks(launched: float, batches: list[dict[str, Any]], busy: MachineBusy) -> dict[str, float]:
    first, last = min(b["started_at"] for b in batches), max(b["committed_at"] for b in batches)
    return {"launch_seconds": round(last - launched, 3), "batch_seconds": round(last - first, 3),
            "batch_busy_cpu_seconds": round(busy.between(first, last), 3), "batches": len(batches)}


def run_mirror(stack: dict[str, str], tmp: Path, stream: ChangeStream, expected: dict[str, dict[int, tuple]],
               batch: int, label: str, transactions: str = "per_key", records: int | None = None,
               root: Path = ROOT, commits: bool = False) -> dict[str, Any]:
    """The mirror pipeline of the checkout at ``root``; with ``transactions`` ``whole`` it also
    reads the transaction topic; with ``records`` (all the topics hold) it runs on the continuous
    engine. ``commits``: the result has each batch's commit time with the change topics' records
    read through it (``cdc_together``)."""
    whole = transactions == "whole"
    topics = stream.topics() + ([str(stream.transaction_topic())] if whole else [])
    config = pipeline_config(stack, tmp, label, topics=topics, spec=None,
                             mirror=mirror_definition(stream, transactions)["mirror"],
                             max_offsets_per_trigger=batch)
    busy = MachineBusy()
    launched = time.time()
    run = (start_app(config, tmp, label=label, root=root) if records is None
           else start_continuous(config, tmp, label=label, root=root))
    try:
        code = run.wait(1800) if records is None else continuous_until_read(run, records)
    except subprocess.TimeoutExpired:
        run.kill()
        raise SystemExit(f"mirror did not finish in 30 minutes:\n{run.log()[-3000:]}") from None
    finally:
        busy.stop()
    events = run.events("batch")
    if code != 0 or not events:
        raise SystemExit(f"mirror failed ({code}):\n{run.log()[-3000:]}")
    if any(e["dead_lettered"] for e in events):
        raise SystemExit(f"mirror dead-lettered records: {[e['dead_lettered'] for e in events]}")
    check_target(stack, config["target_schema"], expected, "mirror")
    conn = pg_connect(stack)
    drop_schemas(conn, config["target_schema"], config["meta_schema"])
    conn.close()
    timings = [e.get("timings_ms", {}) for e in events]
    if commits:
        change_topics = set(stream.topics())
        return {"commits": [(e["committed_at"], end_offsets_sum(e, change_topics)) for e in events]}
    return {**_clocks(launched, events, busy),
            "timings_ms": {k: sum(t.get(k, 0) for t in timings) for k in sorted({k for t in timings for k in t})}}


def run_peer(stack: dict[str, str], tmp: Path, stream: ChangeStream, expected: dict[str, dict[int, tuple]],
             batch: int, label: str, write: str) -> dict[str, Any]:
    schema = f"t_{label}"
    create_tables(stack, stream, schema)
    config = {"bootstrap": stack["EOS_KAFKA_BOOTSTRAP"], "topics": stream.topics(), "schemas": stream.schemas,
              "max_offsets_per_trigger": batch, "checkpoint_dir": str(tmp / f"{label}-checkpoint"),
              "target_schema": schema, "write": write, "page_size": 1000,
              "postgres": {"host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
                           "dbname": stack["EOS_PG_DB"], "user": stack["EOS_PG_USER"]}}
    path = tmp / f"{label}.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "PGPASSWORD": stack["EOS_PG_PASSWORD"]}
    busy = MachineBusy()
    launched = time.time()
    done = subprocess.run([*spark_submit("local[2]", stack["EOS_SPARK_JARS"]), "--py-files", str(PEER), str(PEER),
                           str(path)], capture_output=True, text=True, env=env, cwd=tmp, timeout=1800, check=False)
    busy.stop()
    batches = [json.loads(line[len("PEER-BATCH "):]) for line in done.stdout.splitlines()
               if line.startswith("PEER-BATCH ")]
    if done.returncode != 0 or not batches:
        raise SystemExit(f"{label} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    check_target(stack, schema, expected, label)
    conn = pg_connect(stack)
    drop_schemas(conn, schema)
    conn.close()
    return _clocks(launched, batches, busy)


# --- the report --------------------------------------------------------------

def summarize(runs: list[dict[str, Any]], changes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": runs}
    for clock in ("launch", "batch", "batch_busy_cpu"):
        if not all(f"{clock}_seconds" in r for r in runs):
            continue  # a peer's runs, or runs logged before the bench had this clock
        rates = [changes / r[f"{clock}_seconds"] for r in runs]
        out[f"{clock}_changes_per_second"] = {"median": round(statistics.median(rates)), "min": round(min(rates)),
                                              "max": round(max(rates))}
    return out


def ratios(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The mirror's median over the faster peer's, on each clock."""
    out: dict[str, Any] = {}
    peers = [f for f in figures if f.startswith("peer") and f in figures]
    if "mirror" not in figures or not peers:
        return out
    for clock in ("launch", "batch"):
        key = f"{clock}_changes_per_second"
        best = max(peers, key=lambda f: figures[f][key]["median"])
        ratio = figures["mirror"][key]["median"] / figures[best][key]["median"]
        out[f"mirror_vs_peer_{clock}"] = {"ratio": round(ratio, 3), "peer": best}
    return out


def bench_tables(args: argparse.Namespace, stack: dict[str, str], tables: int, tmp: Path) -> dict[str, Any]:
    tag = time.strftime("%H%M%S")
    stream = ChangeStream(tables, args.changes, prefix=f"cdcb{tag}n{tables}", seed=args.seed, schemas=args.schemas,
                          transaction_metadata=any(f.endswith("_whole") for f in args.figures),
                          transaction_changes=args.transaction_changes, begins=args.begins)
    started = time.perf_counter()
    produced = produce(stack, stream, args.partitions)
    print(json.dumps({"tables": tables, "produced": produced, "seconds": round(time.perf_counter() - started, 1)}),
          flush=True)
    expected = stream.final_rows()
    figures = list(args.figures)
    if args.baseline is not None:
        figures += [f"{f}{BASELINE}" for f in args.figures if f.startswith("mirror")]
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in figures}
    for index, figure in in_turn(figures, args.runs):
        label = f"cdc{tag}n{tables}r{index}{figure.replace('_', '').replace(BASELINE, 'base')}"
        if figure.startswith("mirror"):
            plain = figure.removesuffix(BASELINE)
            result = run_mirror(stack, tmp, stream, expected, args.batch, label,
                                "whole" if plain.endswith("_whole") else "per_key",
                                continuous_records(plain, stream, produced),
                                args.baseline if figure.endswith(BASELINE) else ROOT)
        elif figure == "peer_jdbc":
            result = run_jdbc_peer(stack, stream, expected, label, args.partitions,
                                   lambda schema: differences(stack, schema, expected), batch=args.jdbc_batch)
        else:
            result = run_peer(stack, tmp, stream, expected, args.batch, label, figure.removeprefix("peer_"))
        result["load_average"] = load_average()
        runs[figure].append(result)
        print(json.dumps({"tables": tables, "run": index, "figure": figure, **result}), flush=True)
    return {"topics": len(stream.topics()), "final_rows": sum(len(t.rows) for t in stream.tables),
            **tables_result(produced, runs)}


def continuous_records(figure: str, stream: ChangeStream, produced: dict[str, int]) -> int | None:
    """The records a continuous figure's run reads before it is stopped (None: a Spark figure):
    every record with ``whole``, which reads the transaction topic too."""
    if figure == "mirror_continuous_whole":
        return produced["records"]
    return change_records(stream, produced) if figure == "mirror_continuous" else None


def change_records(stream: ChangeStream, produced: dict[str, int]) -> int:
    """The records of the change topics, which a ``per_key`` run reads: without the transaction
    topic's END (and BEGIN, when the stream writes them) of each source transaction, when the
    stream has one."""
    per_transaction = 2 if stream.begins else 1
    return produced["records"] - (per_transaction * produced["transactions"] if stream.transaction_topic() else 0)


def tables_result(produced: dict[str, int], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    changes = produced["c"] + produced["u"] + produced["d"]
    figures = {f: summarize(r, changes) for f, r in runs.items() if r}
    return {"produced": produced, "figures": figures, "ratios": ratios(figures), "whole_cost": whole_costs(runs)}


def whole_costs(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per pair of a ``_whole`` figure and its ``per_key`` one (a baseline's too), on each clock:
    what whole transactions cost, ``1 - whole rate / per_key rate``, of the figures' medians, and
    the median of each round's own cost (run i of both figures, run in the same round: the load
    of the minutes they shared falls on both)."""
    out: dict[str, Any] = {}
    for whole, whole_runs in runs.items():
        per_key = whole.replace("_whole", "")
        if "_whole" not in whole or not runs.get(per_key) or not whole_runs:
            continue
        costs: dict[str, Any] = {}
        for clock in ("batch", "batch_busy_cpu"):
            key = f"{clock}_seconds"
            pairs = [(p[key], w[key]) for p, w in zip(runs[per_key], whole_runs, strict=False) if key in p and key in w]
            if pairs:
                of_medians = 1 - statistics.median(p for p, _ in pairs) / statistics.median(w for _, w in pairs)
                costs[clock] = {"of_medians": round(of_medians, 3),
                                "median_of_rounds": round(statistics.median(1 - p / w for p, w in pairs), 3),
                                "rounds": len(pairs)}
        out[whole] = costs
    return out


def tables_from_log(path: Path) -> dict[str, dict[str, Any]]:
    """Per table count, the figures of the runs a log of this bench printed (its stdout): a
    bench cut short keeps the runs it finished."""
    produced: dict[str, dict[str, int]] = {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line) if line.startswith("{") else {}
        if "produced" in entry:
            produced[str(entry["tables"])] = entry["produced"]
        elif "figure" in entry:
            run = {k: v for k, v in entry.items() if k not in ("tables", "figure")}
            runs.setdefault(str(entry["tables"]), {}).setdefault(entry["figure"], []).append(run)
    return {tables: tables_result(produced[tables], runs[tables]) for tables in produced if tables in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=300_000, help="row changes in all (tombstones on top)")
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 20])
    parser.add_argument("--batch", type=int, default=50_000, help="maxOffsetsPerTrigger (records)")
    parser.add_argument("--partitions", type=int, default=2, help="partitions of each change topic")
    parser.add_argument("--schemas", action="store_true", help="the JSON converter's schemas.enable=true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--transaction-changes", type=int, default=8,
                        help="source transactions of 1 to this many changes, as many of each size")
    parser.add_argument("--begins", action="store_true",
                        help="the transaction topic with its BEGINs, as a connector without the BEGINs' filter "
                             "writes it (postgres_connector_config's drops them): what reading them costs the "
                             "_whole figures")
    parser.add_argument("--figures", default=",".join(DEFAULT_FIGURES), type=lambda text: text.split(","))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cdc_throughput.json"))
    parser.add_argument("--jdbc-batch", type=int, default=JDBC_BATCH,
                        help="peer_jdbc's batch.size and consumer max.poll.records")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit: its mirror figures run "
                        "too, in the same rounds, named <figure>@baseline")
    parser.add_argument("--from-log", type=Path, help="no runs: the report of the runs a log of this bench printed")
    args = parser.parse_args()
    unknown = set(args.figures) - set(FIGURES)
    if unknown:
        raise SystemExit(f"unknown figures {sorted(unknown)}")
    load_at_start = load_average()
    if args.from_log:
        by_tables = tables_from_log(args.from_log)
    else:
        stack = connect_stack() if "peer_jdbc" in args.figures else local_stack()
        tmp = Path("/tmp") / f"eos-cdc-bench-{time.strftime('%H%M%S')}"
        tmp.mkdir(parents=True)
        by_tables = {str(tables): bench_tables(args, stack, tables, tmp) for tables in args.tables}
    report = {"command": " ".join([Path(sys.argv[0]).resolve().relative_to(ROOT).as_posix(), *sys.argv[1:]]),
              "code": git_commit(ROOT), "baseline_code": git_commit(args.baseline) if args.baseline else None,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), "load_average_at_start": load_at_start, "load_average_at_end": load_average(),
              "changes": args.changes, "max_offsets_per_trigger": args.batch, "partitions_per_topic": args.partitions,
              "converter": f"JsonConverter, schemas.enable={str(args.schemas).lower()}", "runs": args.runs,
              "seed": args.seed, "transaction_changes": f"1-{args.transaction_changes}",
              "transaction_begins": args.begins, "tables": by_tables}
    if "peer_jdbc" in args.figures:
        report["jdbc_batch"] = args.jdbc_batch
    if "1" in by_tables and "20" in by_tables:
        report["routing_cost_20_vs_1_tables"] = {
            figure: round(by_tables["20"]["figures"][figure]["batch_changes_per_second"]["median"]
                          / by_tables["1"]["figures"][figure]["batch_changes_per_second"]["median"], 3)
            for figure in args.figures if figure in by_tables["20"]["figures"] and figure in by_tables["1"]["figures"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'tables':<8}{'figure':<26}{'launch changes/s':>18}{'batch changes/s':>18}{'per busy CPU-s':>16}")
    for tables, result in by_tables.items():
        for figure, f in result["figures"].items():
            cpu = f.get("batch_busy_cpu_changes_per_second", {}).get("median", "")
            print(f"{tables:<8}{figure:<26}{f['launch_changes_per_second']['median']:>18}"
                  f"{f['batch_changes_per_second']['median']:>18}{cpu:>16}")
        print(json.dumps(result["ratios"]))
        print(json.dumps(result.get("whole_cost", {})))


if __name__ == "__main__":
    main()
