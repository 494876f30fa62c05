"""What each step of the staging job costs, in one Spark driver, on one clock.

    .venv/bin/python bench/record_paths.py --events 400000 --runs 3

The pipeline's staging job reads Kafka, hands Arrow batches to Python, parses
and encodes every record, and COPYs it into PostgreSQL. This benchmark times
the same topic through growing prefixes of that job, without the COPY, so the
differences between figures are what each step costs here:

* ``read_noop``: the Kafka read (``read_committed``) into the ``noop`` sink;
* ``from_json_noop``: the same plus ``from_json`` of the ledger's fields (no checks);
* ``jvm_lines_noop``: the same plus ``sql_records``' checks and encoding
  (``record_parsing: jvm``), still in the JVM;
* ``arrow_to_python``: the read, handed to Python workers as Arrow batches that
  Python only counts (``mapInArrow``);
* ``python_lines``: the same, and Python parses and encodes every record
  (``record_parsing: python``: ``staging_lines``);
* ``jvm_lines_to_python``: the JVM's lines handed to Python, which passes them
  on (``copy_chunks`` with ``prevalidated``).

One spark-submit ``local[2]``, every figure warmed up once, then ``--runs``
rounds in a shuffled order. Writes bench/results/record_paths.json.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import ledger_topic, local_stack, machine  # noqa: E402

FIGURES = ("read_noop", "from_json_noop", "jvm_lines_noop", "arrow_to_python", "python_lines",
           "jvm_lines_to_python")

# Runs under spark-submit with the repository on sys.path (argv: root, bootstrap, topic, runs, seed).
SCRIPT = '''
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
from pyspark.sql import SparkSession, functions as F, types as T
from spark_apps.eos_stream import sql_records
from spark_apps.eos_stream.sink.staging import copy_chunks
from spark_apps.eos_stream.spec import load_spec

root, bootstrap, topic, runs, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
spark = SparkSession.builder.getOrCreate()
spec = load_spec("spark_apps.ledger.spec:LEDGER")
schema = T.StructType([T.StructField(f.name, T.LongType() if f.pg_type == "bigint" else T.StringType())
                       for f in spec.fields])

def read():
    return (spark.read.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("subscribe", topic)
            .option("kafka.isolation.level", "read_committed").load()
            .select("topic", "partition", "offset", "key", "value"))

def noop(df):
    df.write.format("noop").mode("overwrite").save()

def in_python(prevalidated):
    def run(batches):
        import pyarrow as pa
        counts, size = {"staged": 0, "parsed_in_python": 0}, 0
        if prevalidated is None:  # only count: the Arrow hand-over alone
            for batch in batches:
                size += batch.num_rows
        else:
            for chunk in copy_chunks(batches, spec, False, counts, prevalidated):
                size += len(chunk)
        yield pa.RecordBatch.from_pydict({"n": pa.array([size], pa.int64())})
    return run

figures = {
    "read_noop": lambda: noop(read()),
    "from_json_noop": lambda: noop(read().select(F.from_json(F.col("value").cast("string"), schema).alias("v"))
                                   .select("v.*")),
    "jvm_lines_noop": lambda: noop(sql_records.with_staging_line(read(), spec)),
    "arrow_to_python": lambda: read().mapInArrow(in_python(None), "n long").collect(),
    "python_lines": lambda: read().mapInArrow(in_python(False), "n long").collect(),
    "jvm_lines_to_python": lambda: sql_records.with_staging_line(read(), spec)
                                   .mapInArrow(in_python(True), "n long").collect(),
}
for action in figures.values():
    action()  # warm-up: JIT, Python workers, the Kafka consumers' pool
rng = random.Random(seed)
for round_number in range(runs):
    order = list(figures)
    rng.shuffle(order)
    for name in order:
        started = time.perf_counter()
        figures[name]()
        print("FIGURE " + json.dumps({"round": round_number, "figure": name,
                                      "seconds": time.perf_counter() - started}), flush=True)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=400_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "record_paths.json"))
    args = parser.parse_args()
    stack = local_stack()
    topic, _ = ledger_topic(stack, "paths", args.events)
    script = Path("/tmp") / f"eos-bench-record-paths-{os.getpid()}.py"
    script.write_text(SCRIPT)
    try:
        out = subprocess.run(
            [str(Path(sys.executable).with_name("spark-submit")), "--master", "local[2]",
             "--jars", stack["EOS_SPARK_JARS"], "--conf", "spark.ui.enabled=false",
             "--conf", "spark.driver.host=127.0.0.1", "--driver-memory", "1g", str(script), str(ROOT),
             stack["EOS_KAFKA_BOOTSTRAP"], topic, str(args.runs), str(args.seed)],
            capture_output=True, text=True, env={**os.environ, "PYSPARK_PYTHON": sys.executable}, check=False)
    finally:
        script.unlink()
    timed = [json.loads(line[len("FIGURE "):]) for line in out.stdout.splitlines() if line.startswith("FIGURE ")]
    if len(timed) != args.runs * len(FIGURES):
        raise SystemExit(f"record paths failed:\n{out.stderr[-3000:]}")
    figures = {}
    for name in FIGURES:
        seconds = [t["seconds"] for t in timed if t["figure"] == name]
        median = statistics.median(seconds)
        figures[name] = {"seconds": [round(s, 3) for s in seconds], "median_seconds": round(median, 3),
                         "rows_per_second": round(args.events / median)}
    base = figures["read_noop"]["median_seconds"]
    steps_us = {  # wall microseconds per record that each step adds (2 cores share the work)
        "from_json": figures["from_json_noop"]["median_seconds"] - base,
        "jvm_checks_and_encoding": figures["jvm_lines_noop"]["median_seconds"] - base,
        "arrow_to_python": figures["arrow_to_python"]["median_seconds"] - base,
        "python_parse_and_encode": (figures["python_lines"]["median_seconds"]
                                    - figures["arrow_to_python"]["median_seconds"]),
    }
    report = {"events": args.events, "runs": args.runs, "seed": args.seed, "master": "local[2]",
              "machine": machine(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "figures": figures,
              "added_wall_us_per_record": {k: round(v * 1e6 / args.events, 2) for k, v in steps_us.items()}}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'figure':<22}{'median s':>10}{'rows/s':>10}")
    for name, figure in figures.items():
        print(f"{name:<22}{figure['median_seconds']:>10}{figure['rows_per_second']:>10}")
    print(json.dumps(report["added_wall_us_per_record"], indent=2))


if __name__ == "__main__":
    main()
