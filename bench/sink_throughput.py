"""Throughput of the pipeline against its peers and ceilings, on one clock.

    .venv/bin/python bench/sink_throughput.py --events 1000000 --batch 100000 --runs 3

One topic of N ledger events (4 partitions, committed in transactions of 5,000) is read by every
figure, ``--runs`` rounds, the figures in a shuffled order in each round (the seed is recorded).
Every figure is a rate over the same clock: rows from the first read to the last commit, after a
warm-up.

* **Pipeline modes** (the app, spark-submit ``local[2]``, ``availableNow``, ``maxOffsetsPerTrigger``
  = ``--batch``): every batch but the first, which carries the JVM's and the Python workers'
  warm-up, from the second batch's start to the last batch's commit (the sink's ``started_at`` and
  ``committed_at``); rows are those batches' input rows. Each run has its own pipeline and target
  schema. A baseline build that does not report those times is clocked by the sum of Spark's batch
  durations (``triggerExecution``), the same clock where batches do not overlap.
* **Spark peers** (one spark-submit ``local[2]`` for all three, warmed up by one full untimed read
  of the topic first): ``spark_noop``, the topic read with ``read_committed`` into the ``noop``
  sink; ``spark_from_json_noop``, the same plus ``from_json`` of the ledger's fields (no Spark
  pipeline here can beat these: the ceilings); ``spark_jdbc``, ``df.write.jdbc`` of the parsed rows
  into ``ledger_events`` (at-least-once; ``batchsize`` 10,000, ``reWriteBatchedInserts``, one
  partition per Kafka partition; its rows are counted after the clock).
* **Python peers** (this process; the Kafka consume happens before the clock for the two raw COPYs):
  ``raw_copy_preencoded``, COPY of already encoded ``ledger_events`` rows (PostgreSQL's own
  ceiling); ``raw_copy_encoded``, the same with ``staging_lines`` encoding inside the clock;
  ``python_reference``, the pipeline a user might write by hand: one confluent-kafka consumer,
  ``parse_record`` per record and COPY, all inside the clock; ``python_reference_tuned``, the same
  with the one consumer setting the pipeline's readers change (``fetch.queue.backoff.ms``, 1 s by
  default).

``--baseline DIR`` runs ``BASELINE_MODES`` with another checkout's app too (a git worktree of an
older commit, sharing this one's .venv and .local), in the same rounds and the same shuffle, as
``<mode>@baseline``: before and after on one clock. The baseline's ratios go under ``baseline``.
``ratios.recovery_100k_seconds`` and ``recovery_1m_seconds`` are read from ``--recovery``
(bench/results/recovery_times.json): restore + replay + audit at 100k and 1M events with the
definition's defaults.

``exactly_once_staged`` is ``exactly_once`` with prepared parts turned off
(``EOS_PREPARED_PARTS=0``): every batch staged and applied in SQL, the path before them and the one
a batch falls back to. ``exactly_once_continuous``: on the continuous engine, stopped once its
cycles hold every event. ``exactly_once_local1`` and ``exactly_once_local4`` are the scaling figure:
the same pipeline with one task slot, and with four on the same two cores. Each mode's run also
records which processes used the cores during its warm batches (``bench/cpu_share.py``).

Writes bench/results/sink_throughput.json (``figures`` with every run, ``phases`` per batch,
``ratios`` against the issue's targets) and prints a table.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from psycopg2 import sql  # noqa: E402

from bench.common import PARTITIONS, git_commit, ledger_topic, local_stack, machine  # noqa: E402
from bench.cpu_share import CpuShare  # noqa: E402
from bench.harness import (  # noqa: E402
    continuous_until_read,
    pg_connect,
    pipeline_config,
    start_app,
    start_continuous,
    warm_cycles,
)
from spark_apps.eos_stream.kafka.ranges import FETCH_QUEUE_BACKOFF_MS  # noqa: E402
from spark_apps.eos_stream.records.parsing import parse_record, staging_lines  # noqa: E402
from spark_apps.eos_stream.run.preflight import PREPARED_PARTS_ENV  # noqa: E402
from spark_apps.eos_stream.state.ddl import run_ddl  # noqa: E402
from spark_apps.ledger.spec import LEDGER, ledger_ddl  # noqa: E402

# name -> (delivery, spec attribute, Spark master)
MODES = {
    "exactly_once": ("exactly_once", "LEDGER", "local[2]"),
    # exactly_once with every batch staged and applied in SQL, as before prepared parts: before and after.
    "exactly_once_staged": ("exactly_once", "LEDGER", "local[2]"),
    "at_least_once": ("at_least_once", "LEDGER", "local[2]"),
    "two_phase": ("two_phase", "LEDGER", "local[2]"),
    "exactly_once_events_only": ("exactly_once", "LEDGER_EVENTS_ONLY", "local[2]"),
    # The scaling figure: the same pipeline with one task slot, and with four on the same two cores.
    "exactly_once_local1": ("exactly_once", "LEDGER", "local[1]"),
    "exactly_once_local4": ("exactly_once", "LEDGER", "local[4]"),
    # One Python process, no Spark ("continuous" is no master); its peer: python_reference_tuned.
    "exactly_once_continuous": ("exactly_once", "LEDGER", "continuous"),
}
# Figures of the --baseline checkout's app: "<mode>@baseline".
BASELINE_SUFFIX = "@baseline"
SPARK_PEERS = ("spark_noop", "spark_from_json_noop", "spark_jdbc")
PYTHON_PEERS = ("raw_copy_preencoded", "raw_copy_encoded", "python_reference", "python_reference_tuned")
# Modes that --baseline runs with the other checkout's app too (its defaults: a baseline
# build's own switches are not ours to name).
BASELINE_MODES = ("exactly_once",)
TARGETS = {  # ratio -> (comparison, target): issue 25's
    "exactly_once_vs_jdbc": (">=", 1.0),
    "exactly_once_vs_python_reference": (">=", 1.0),
    "exactly_once_vs_noop_ceiling": (">=", 0.6),
    "exactly_once_vs_at_least_once": (">=", 0.9),
    "recovery_100k_seconds": ("<=", 5.0),
    "recovery_1m_seconds": ("<=", 20.0),
}


# --- the pipeline's modes ----------------------------------------------------

def warm_batches(stack: dict, meta_schema: str, pipeline: str) -> list[dict[str, Any]]:
    """Every batch but the first: (input rows, Spark's durations)."""
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT batch_id, input_rows, batch_duration_ms, durations_ms FROM {} WHERE pipeline = %s"
                            " ORDER BY batch_id").format(sql.Identifier(meta_schema, "stream_progress")), (pipeline,))
        rows = cur.fetchall()
    conn.close()
    return [{"batch_id": b, "rows": int(n or 0), "ms": int(ms or 0),
             "durations": d if isinstance(d, dict) else json.loads(d or "{}")} for b, n, ms, d in rows[1:]]


def run_mode(stack: dict, tmp: Path, topic: str, name: str, figure: str, batch: int, events: int,
             baseline: Path | None = None) -> dict[str, Any]:
    """One run of a pipeline mode; ``baseline``: the app of that checkout instead of this one. The
    continuous engine, which never ends by itself, is stopped once its cycles hold all ``events``."""
    delivery, spec, master = MODES[figure.removesuffix(BASELINE_SUFFIX)]
    config = pipeline_config(stack, tmp, name, delivery=delivery, spec=f"spark_apps.ledger.spec:{spec}",
                             topics=[topic], max_offsets_per_trigger=batch)
    env = {PREPARED_PARTS_ENV: "0"} if figure == "exactly_once_staged" else None
    root = baseline or ROOT
    run = (start_continuous(config, tmp, env_extra=env, label=name, root=root) if master == "continuous"
           else start_app(config, tmp, env_extra=env, label=name, root=root, master=master))
    cpu = CpuShare(run.process.pid, run.log_path)
    try:
        code = continuous_until_read(run, events) if master == "continuous" else run.wait(1800)
    except subprocess.TimeoutExpired:
        run.kill()
        raise SystemExit(f"{figure} did not finish in 30 minutes:\n{run.log()[-3000:]}") from None
    share = cpu.result()
    if code != 0:
        raise SystemExit(f"{figure} failed:\n{run.log()[-3000:]}")
    if master == "continuous":
        return {**warm_cycles(run.events("batch")), "cpu": share}
    warm = warm_batches(stack, config["meta_schema"], name)
    sink = {e["batch_id"]: e for e in run.events("batch")}
    phases = []
    for b in warm:
        timings = sink.get(b["batch_id"], {}).get("timings_ms", {})
        sink_ms = sum(v for k, v in timings.items() if k != "stage_slowest_task")  # within "stage"
        phases.append({**{f"spark_{k}": v for k, v in b["durations"].items()},
                       **{f"sink_{k}": v for k, v in timings.items()},
                       "fixed_overhead": b["durations"].get("triggerExecution", b["ms"]) - sink_ms,
                       "rows": b["rows"]})
    rows = sum(b["rows"] for b in warm)
    return {"rows": rows, **_warm_clock(warm, sink), "phases": phases, "cpu": share}


def _warm_clock(warm: list[dict[str, Any]], sink: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Seconds of the warm batches. Batches commit one at a time and in order, so the warm
    batches' rows took from the warm-up batch's commit to the last commit; that clock holds
    where batches overlap (apply-ahead stages and applies a batch while Spark prepares the
    next, so Spark's batch durations hold neither) and where they do not. A build that reports
    when a batch started and committed but applies its warm-up batch ahead of the next start:
    from the first warm batch's start instead. A build that reports neither (a baseline's): the
    sum of Spark's durations, the same clock where batches do not overlap."""
    warm_up = sink.get(warm[0]["batch_id"] - 1, {}) if warm else {}
    if warm and "committed_at" in warm_up and all("committed_at" in sink.get(b["batch_id"], {}) for b in warm):
        last = max(sink[b["batch_id"]]["committed_at"] for b in warm)
        return {"seconds": round(last - warm_up["committed_at"], 3), "clock": "warm-up commit to last commit"}
    if warm and all("started_at" in sink.get(b["batch_id"], {}) for b in warm):
        first, last = sink[warm[0]["batch_id"]], max(sink[b["batch_id"]]["committed_at"] for b in warm)
        return {"seconds": round(last - first["started_at"], 3), "clock": "first warm start to last commit"}
    return {"seconds": round(sum(b["ms"] for b in warm) / 1000, 3), "clock": "sum of triggerExecution"}


# --- Spark's own peers -------------------------------------------------------

# Runs under spark-submit; the password arrives through the environment only.
SPARK_PEERS_SCRIPT = '''
import json, os, sys, time
from pyspark.sql import SparkSession, functions as F, types as T
bootstrap, topic, partitions, host, port, db, user, schema, figures = sys.argv[1:10]
spark = SparkSession.builder.getOrCreate()
fields = T.StructType([T.StructField("event_id", T.StringType()), T.StructField("account_id", T.StringType()),
                       T.StructField("amount_cents", T.LongType()), T.StructField("ts", T.StringType()),
                       T.StructField("seq", T.LongType())])
def read():
    return (spark.read.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("subscribe", topic)
            .option("kafka.isolation.level", "read_committed").load())
def parsed():
    v = F.from_json(F.col("value").cast("string"), fields).alias("v")
    return read().select(F.col("topic").alias("kafka_topic"), F.col("partition").alias("kafka_partition"),
                         F.col("offset").alias("kafka_offset"), v).select(
        "kafka_topic", "kafka_partition", "kafka_offset", "v.event_id", "v.account_id", "v.amount_cents",
        F.to_timestamp("v.ts").alias("ts"), "v.seq")
url = f"jdbc:postgresql://{host}:{port}/{db}?reWriteBatchedInserts=true"
props = {"user": user, "password": os.environ["EOS_PG_PASSWORD"], "driver": "org.postgresql.Driver",
         "batchsize": "10000", "numPartitions": partitions}
table = f'"{schema}".ledger_events'
parsed().write.format("noop").mode("overwrite").save()  # warm-up: one full untimed read
parsed().limit(1000).write.jdbc(url, table, mode="append", properties=props)  # and the JDBC path
def timed(name, action):
    started = time.perf_counter()
    action()
    print("PEER " + json.dumps({"figure": name, "seconds": time.perf_counter() - started}), flush=True)
for name in figures.split(","):
    if name == "spark_noop":
        timed(name, lambda: read().write.format("noop").mode("overwrite").save())
    elif name == "spark_from_json_noop":
        timed(name, lambda: parsed().write.format("noop").mode("overwrite").save())
    elif name == "spark_jdbc":
        timed(name, lambda: parsed().write.jdbc(url, table, mode="append", properties=props))
'''


def spark_peers(stack: dict, tmp: Path, topic: str, events: int, order: list[str], tag: str) -> dict[str, dict]:
    schema = f"jdbc{tag}"
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        run_ddl(cur, ledger_ddl(schema))
    conn.close()
    script = tmp / "spark_peers.py"
    script.write_text(SPARK_PEERS_SCRIPT)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    jars = ",".join([stack["EOS_SPARK_JARS"], stack["EOS_PG_JDBC_JAR"]])
    out = subprocess.run(
        [str(Path(sys.executable).with_name("spark-submit")), "--master", "local[2]", "--jars", jars,
         "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1", "--driver-memory", "1g",
         str(script), stack["EOS_KAFKA_BOOTSTRAP"], topic, str(PARTITIONS), stack["EOS_PG_HOST"],
         stack["EOS_PG_PORT"], stack["EOS_PG_DB"], stack["EOS_PG_USER"], schema, ",".join(order)],
        capture_output=True, text=True, env=env, check=False)
    timed = [json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("PEER ")]
    if len(timed) != len(order):
        raise SystemExit(f"spark peers failed:\n{out.stderr[-3000:]}")
    conn = pg_connect(stack)
    with conn.cursor() as cur:  # the JDBC peer's rows, counted after its clock (1000 are the warm-up's)
        cur.execute(sql.SQL("SELECT count(*) - 1000 FROM {}.ledger_events").format(sql.Identifier(schema)))
        jdbc_rows = int(cur.fetchone()[0])
        cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    conn.close()
    return {t["figure"]: {"rows": jdbc_rows if t["figure"] == "spark_jdbc" else events,
                          "seconds": round(t["seconds"], 3)} for t in timed}


# --- Python peers ------------------------------------------------------------

def _consumer(stack: dict, topic: str, tuned: bool = False) -> Any:
    """The peers' consumer: librdkafka's defaults, as a hand-written loop has them; ``tuned``
    adds the one setting the pipeline's readers change (``kafka_ranges.FETCH_QUEUE_BACKOFF_MS``)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"], "group.id": "bench",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         **({"fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS} if tuned else {})})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    return consumer


def _consume(stack: dict, topic: str, events: int) -> list[tuple]:
    consumer = _consumer(stack, topic)
    records: list[tuple] = []
    while len(records) < events:
        records.extend((m.topic(), m.partition(), m.offset(), None, m.value())
                       for m in consumer.consume(10000, timeout=2) if not m.error())
    consumer.close()
    return records


def _event_line(staging_line: str) -> str:
    """A staging line minus key/value/error: exactly a ledger_events row."""
    cells = staging_line.rstrip("\n").split("\t")
    return "\t".join(cells[:3] + cells[6:]) + "\n"


def _copy_events(stack: dict, schema: str, text: Any) -> None:
    conn = pg_connect(stack)
    conn.autocommit = False
    with conn.cursor() as cur:
        cur.copy_expert(sql.SQL("COPY {}.ledger_events FROM STDIN").format(sql.Identifier(schema)).as_string(cur),
                        text)
    conn.commit()
    conn.close()


def python_peer(stack: dict, topic: str, events: int, figure: str, tag: str) -> dict[str, Any]:
    schema = f"py{tag}{figure[:8]}"
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        run_ddl(cur, ledger_ddl(schema))
    conn.close()
    if figure.startswith("python_reference"):
        started = time.perf_counter()
        consumer = _consumer(stack, topic, tuned=figure == "python_reference_tuned")
        count = 0

        def lines():
            nonlocal count
            while count < events:
                for m in consumer.consume(10000, timeout=2):
                    if m.error():
                        continue
                    count += 1
                    r = parse_record(LEDGER, m.value())
                    yield (f"{m.topic()}\t{m.partition()}\t{m.offset()}\t{r['event_id']}\t{r['account_id']}\t"
                           f"{r['amount_cents']}\t{r['ts']}\t{r['seq']}\n")

        _copy_events(stack, schema, _IterText(lines()))
        seconds = time.perf_counter() - started
        consumer.close()
    else:
        records = _consume(stack, topic, events)
        count = len(records)
        if figure == "raw_copy_preencoded":
            text = "".join(_event_line(line) for line in staging_lines(LEDGER, records, keep_raw=False))
            started = time.perf_counter()
            _copy_events(stack, schema, io.StringIO(text))
        else:
            started = time.perf_counter()
            _copy_events(stack, schema, _IterText(_event_line(line)
                                                  for line in staging_lines(LEDGER, records, keep_raw=False)))
        seconds = time.perf_counter() - started
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    conn.close()
    return {"rows": count, "seconds": round(seconds, 3)}


class _IterText:
    """A file-like view of an iterator of text lines, read by COPY in ~1 MiB chunks."""

    def __init__(self, lines: Any) -> None:
        self._lines = iter(lines)

    def read(self, size: int = 1 << 20) -> str:
        chunk, filled = [], 0
        for line in self._lines:
            chunk.append(line)
            filled += len(line)
            if filled >= size:
                break
        return "".join(chunk)

    readline = read


# --- the report --------------------------------------------------------------

def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["rows"] / r["seconds"] for r in runs if r["seconds"]]
    return {"rows": [r["rows"] for r in runs], "seconds": [r["seconds"] for r in runs],
            "rows_per_second": [round(x) for x in rates], "min": round(min(rates)),
            "median": round(statistics.median(rates)), "max": round(max(rates))}


def median_phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per-batch medians over the warm batches of every run of a mode (ms)."""
    batches = [p for r in runs for p in r.get("phases", []) if p["rows"] > 0]
    keys = sorted({k for p in batches for k in p if k != "rows"})
    return {k: statistics.median(p.get(k, 0) for p in batches) for k in keys} | {
        "rows": statistics.median(p["rows"] for p in batches)} if batches else {}


def _meets(value: float | None, op: str, target: float) -> bool | None:
    """Whether a measured ratio meets its target (None: not measured)."""
    if value is None:
        return None
    return value >= target if op == ">=" else value <= target


def ratios(figures: dict[str, dict], recovery: dict[str, float | None], build: str = "") -> dict[str, float | None]:
    """The ratios of this build's modes (``build``: "" or BASELINE_SUFFIX) against the same peers."""
    def ratio(a: str, b: str) -> float | None:
        if a in figures and b in figures:
            return round(figures[a]["median"] / figures[b]["median"], 3)
        return None

    exactly_once = f"exactly_once{build}"
    measured = {
        "exactly_once_vs_raw_copy": ratio(exactly_once, "raw_copy_encoded"),
        "exactly_once_vs_jdbc": ratio(exactly_once, "spark_jdbc"),
        "exactly_once_vs_at_least_once": ratio(exactly_once, f"at_least_once{build}"),
        "exactly_once_vs_noop_ceiling": ratio(exactly_once, "spark_from_json_noop"),
        **recovery,
        "exactly_once_vs_raw_copy_preencoded": ratio(exactly_once, "raw_copy_preencoded"),
        "exactly_once_vs_read_noop": ratio(exactly_once, "spark_noop"),
        "exactly_once_vs_python_reference": ratio(exactly_once, "python_reference"),
        "exactly_once_vs_python_reference_tuned": ratio(exactly_once, "python_reference_tuned"),
        "two_phase_vs_exactly_once": ratio(f"two_phase{build}", exactly_once),
    }
    if not build:
        measured["exactly_once_local2_vs_local1"] = ratio("exactly_once", "exactly_once_local1")
        measured["exactly_once_local4_vs_local2"] = ratio("exactly_once_local4", "exactly_once")
        measured["exactly_once_vs_baseline"] = ratio("exactly_once", f"exactly_once{BASELINE_SUFFIX}")
        measured["prepared_parts_vs_staged"] = ratio("exactly_once", "exactly_once_staged")
    return measured


def recovery_from(path: Path) -> tuple[dict[str, float | None], str]:
    """restore + replay + audit at 100k and 1M events with the definition's defaults
    (bench/recovery_times.py's ``recovery_<size>_seconds``), and where they come from: the file
    and the commit it records."""
    keys = ("recovery_100k_seconds", "recovery_1m_seconds")
    if not path.exists():
        return dict.fromkeys(keys), f"{path.name}: not found"
    report = json.loads(path.read_text())
    return {key: report.get(key) for key in keys}, f"{path.name}, code {report.get('code', 'not recorded')}"


def _run_rounds(args: argparse.Namespace, chosen: list[str], stack: dict[str, str], topic: str, tag: str,
                tmp: Path) -> dict[str, list[dict[str, Any]]]:
    """Every chosen figure measured once per round, in an order shuffled anew each round."""
    rng = random.Random(args.seed)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    for round_number in range(args.runs):
        units = [name for name in chosen if name.removesuffix(BASELINE_SUFFIX) in MODES or name in PYTHON_PEERS]
        spark_units = [name for name in chosen if name in SPARK_PEERS]
        if spark_units:
            units.append("spark_peers")
        rng.shuffle(units)
        rng.shuffle(spark_units)
        for unit in units:
            # Every unit its own pipeline: a shared name would resume another mode's offsets and
            # read its progress rows (three modes share their first ten letters).
            label = f"b{tag}r{round_number}u{units.index(unit)}"
            if unit == "spark_peers":
                timed = spark_peers(stack, tmp, topic, args.events, spark_units, f"{tag}r{round_number}")
                for name, result in timed.items():
                    runs[name].append(result)
                    print(json.dumps({"round": round_number, "figure": name, **result}), flush=True)
                continue
            if unit.removesuffix(BASELINE_SUFFIX) in MODES:
                result = run_mode(stack, tmp, topic, label.replace("_", ""), unit, args.batch, args.events,
                                  args.baseline if unit.endswith(BASELINE_SUFFIX) else None)
            else:
                result = python_peer(stack, topic, args.events, unit, f"{tag}r{round_number}")
            runs[unit].append(result)
            print(json.dumps({"round": round_number, "figure": unit,
                              **{k: v for k, v in result.items() if k != "phases"}}), flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=100_000, help="maxOffsetsPerTrigger")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--figures", default=",".join([*MODES, *SPARK_PEERS, *PYTHON_PEERS]))
    parser.add_argument("--recovery", default=str(ROOT / "bench" / "results" / "recovery_times.json"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "sink_throughput.json"))
    parser.add_argument("--baseline", type=Path,
                        help="another checkout (e.g. a git worktree of an older commit): its app runs "
                             f"{', '.join(BASELINE_MODES)} too, in the same rounds, as <mode>@baseline")
    args = parser.parse_args()
    chosen = args.figures.split(",")
    if args.baseline:
        chosen += [f"{name}{BASELINE_SUFFIX}" for name in chosen if name in BASELINE_MODES]
    unknown = {name.removesuffix(BASELINE_SUFFIX) for name in chosen} - {*MODES, *SPARK_PEERS, *PYTHON_PEERS}
    if unknown:
        raise SystemExit(f"unknown figures {sorted(unknown)}")
    stack = local_stack()
    topic, tag = ledger_topic(stack, "ledger", args.events)
    tmp = Path("/tmp") / f"eos-bench-{tag}"
    tmp.mkdir(parents=True)

    runs = _run_rounds(args, chosen, stack, topic, tag, tmp)

    figures = {name: summarize(r) for name, r in runs.items() if r}
    phases = {name: median_phases(r) for name, r in runs.items()
              if name.removesuffix(BASELINE_SUFFIX) in MODES and r}
    recovery, recovery_source = recovery_from(Path(args.recovery))
    measured = ratios(figures, recovery)
    cpu = {name: [r["cpu"] for r in rs if r.get("cpu")] for name, rs in runs.items() if name in MODES}
    meets = {k: _meets(measured[k], op, t) for k, (op, t) in TARGETS.items()}
    report = {"events": args.events, "max_offsets_per_trigger": args.batch, "runs": args.runs, "seed": args.seed,
              "masters": {name: MODES[name][2] for name in MODES}, "machine": machine(),
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "code": git_commit(ROOT),
              "recovery_source": recovery_source,
              "figures": figures, "phases": phases, "cpu_share_of_warm_batches": cpu, "ratios": measured,
              "targets": {k: f"{op} {t}" for k, (op, t) in TARGETS.items()}, "meets": meets}
    if args.baseline:
        report["baseline"] = {"commit": git_commit(args.baseline),
                              "ratios": ratios(figures, {}, BASELINE_SUFFIX)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'figure':<28}{'median rows/s':>14}{'min':>10}{'max':>10}")
    for name, f in figures.items():
        print(f"{name:<28}{f['median']:>14}{f['min']:>10}{f['max']:>10}")
    print(json.dumps({"ratios": measured, "meets": meets}, indent=2))


if __name__ == "__main__":
    main()
