"""Side-by-side throughput of the sink's delivery modes, one run, same data.

Every mode runs the full pipeline (Kafka -> Spark -> PostgreSQL) over the same
topic. Rows per second are measured on Spark's own batch durations (the
``triggerExecution`` of every micro-batch), so JVM start-up is not counted.
Two reference points are measured in the same run:

* raw COPY of the same rows into PostgreSQL, from pre-encoded lines: the ceiling;
* Spark's own ``df.write.jdbc`` (at-least-once, PostgreSQL JDBC driver): the peer.

    .venv/bin/python bench/sink_throughput.py --events 200000

Writes bench/results/sink_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from psycopg2 import sql  # noqa: E402

from demo.env_files import read_env_file  # noqa: E402
from spark_apps.eos_stream.ddl import run_ddl  # noqa: E402
from spark_apps.eos_stream.records import staging_lines  # noqa: E402
from spark_apps.ledger.generator import ensure_topic, produce_ledger  # noqa: E402
from spark_apps.ledger.spec import LEDGER, ledger_ddl  # noqa: E402
from tests.streaming import pg_connect, pipeline_config, run_app  # noqa: E402


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kb = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal")))
    pg_version = subprocess.run(["psql", "--version"], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version(), "postgres_client": pg_version}


def processing_seconds(stack: dict, meta_schema: str, pipeline: str, skip_first: bool = False) -> tuple[float, int]:
    """Summed micro-batch durations and rows; ``skip_first`` leaves out the first
    batch, which carries the JVM's and the Python workers' warm-up."""
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT sum(batch_duration_ms), sum(input_rows) FROM {t}"
                            " WHERE pipeline = %s AND batch_id > {floor}").format(
            t=sql.Identifier(meta_schema, "stream_progress"),
            floor=sql.SQL("(SELECT min(batch_id) FROM {} WHERE pipeline = %s)").format(
                sql.Identifier(meta_schema, "stream_progress")) if skip_first else sql.SQL("-1")),
            (pipeline, pipeline) if skip_first else (pipeline,))
        millis, rows = cur.fetchone()
    conn.close()
    return float(millis or 0) / 1000, int(rows or 0)


def run_mode(stack: dict, tmp: Path, topic: str, name: str, delivery: str, spec: str, batch: int) -> dict:
    config = pipeline_config(stack, tmp, name, delivery=delivery, spec=spec, topics=[topic],
                             max_offsets_per_trigger=batch)
    run = run_app(config, tmp, timeout=1200, label=name)
    if run.process.returncode != 0:
        raise SystemExit(f"{name} failed:\n{run.log()[-3000:]}")
    seconds, rows = processing_seconds(stack, config["meta_schema"], name)
    warm_seconds, warm_rows = processing_seconds(stack, config["meta_schema"], name, skip_first=True)
    stage = sum(e["timings_ms"].get("stage", 0) for e in run.events("batch")) / 1000
    apply = sum(e["timings_ms"].get("apply", 0) + e["timings_ms"].get("commit", 0) for e in run.events("batch")) / 1000
    return {"mode": delivery, "spec": spec.split(":")[1], "rows": rows, "seconds": round(seconds, 3),
            "rows_per_second": round(rows / seconds) if seconds else None,
            "warm_rows_per_second": round(warm_rows / warm_seconds) if warm_seconds else None,
            "stage_seconds": round(stage, 3), "apply_commit_seconds": round(apply, 3)}


def _event_line(staging_line: str) -> str:
    """A staging line minus key/value/error: exactly a ledger_events row."""
    cells = staging_line.rstrip("\n").split("\t")
    return "\t".join(cells[:3] + cells[6:]) + "\n"


def raw_copy(stack: dict, topic: str, events: int, schema: str) -> dict:
    """The ceiling: COPY of already-encoded rows straight into the target table."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"], "group.id": "bench",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    metadata = consumer.list_topics(topic, timeout=10)
    consumer.assign([TopicPartition(topic, p, 0) for p in metadata.topics[topic].partitions])
    records = []
    while len(records) < events:
        for message in consumer.consume(10000, timeout=2):
            if not message.error():
                records.append((message.topic(), message.partition(), message.offset(), None, message.value()))
    consumer.close()
    # Encoded before the clock starts: the ceiling is PostgreSQL's COPY alone.
    text = "".join(_event_line(line) for line in staging_lines(LEDGER, records, keep_raw=False))
    conn = pg_connect(stack)
    conn.autocommit = False
    with conn.cursor() as cur:
        run_ddl(cur, ledger_ddl(schema))
        conn.commit()
        started = time.perf_counter()
        cur.copy_expert(sql.SQL("COPY {}.ledger_events FROM STDIN").format(sql.Identifier(schema)).as_string(cur),
                        io.StringIO(text))
        conn.commit()
        seconds = time.perf_counter() - started
    conn.close()
    return {"mode": "raw_copy", "spec": "LEDGER_EVENTS_ONLY", "rows": len(records), "seconds": round(seconds, 3),
            "rows_per_second": round(len(records) / seconds)}


def spark_jdbc(stack: dict, topic: str, schema: str, tmp: Path) -> dict:
    """The peer: Spark's JDBC writer, at-least-once, same parse in the JVM."""
    script = tmp / "jdbc_peer.py"
    script.write_text(JDBC_PEER)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    jars = ",".join([stack["EOS_SPARK_JARS"], stack["EOS_PG_JDBC_JAR"]])
    out = subprocess.run(
        [str(Path(sys.executable).with_name("spark-submit")), "--master", "local[2]", "--jars", jars,
         "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1", "--driver-memory", "1g",
         str(script), stack["EOS_KAFKA_BOOTSTRAP"], topic, stack["EOS_PG_HOST"], stack["EOS_PG_PORT"],
         stack["EOS_PG_DB"], stack["EOS_PG_USER"], schema],
        capture_output=True, text=True, env=env, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("JDBC ")), None)
    if line is None:
        raise SystemExit(f"jdbc peer failed:\n{out.stderr[-3000:]}")
    return json.loads(line[5:])


# Runs under spark-submit; the password arrives through the environment only.
JDBC_PEER = '''
import json, os, sys, time
from pyspark.sql import SparkSession, functions as F, types as T
bootstrap, topic, host, port, db, user, schema = sys.argv[1:8]
spark = SparkSession.builder.getOrCreate()
fields = T.StructType([T.StructField("event_id", T.StringType()), T.StructField("account_id", T.StringType()),
                       T.StructField("amount_cents", T.LongType()), T.StructField("ts", T.StringType()),
                       T.StructField("seq", T.LongType())])
def load():
    df = (spark.read.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("subscribe", topic)
          .option("kafka.isolation.level", "read_committed").load())
    v = F.from_json(F.col("value").cast("string"), fields).alias("v")
    return df.select(F.col("topic").alias("kafka_topic"), F.col("partition").alias("kafka_partition"),
                     F.col("offset").alias("kafka_offset"), v).select("kafka_topic", "kafka_partition",
                     "kafka_offset", "v.event_id", "v.account_id", "v.amount_cents",
                     F.to_timestamp("v.ts").alias("ts"), "v.seq")
props = {"user": user, "password": os.environ["EOS_PG_PASSWORD"], "driver": "org.postgresql.Driver",
         "batchsize": "10000", "reWriteBatchedInserts": "true"}
url = f"jdbc:postgresql://{host}:{port}/{db}"
load().limit(1000).write.jdbc(url, f'"{schema}".ledger_events', mode="append", properties=props)  # warm-up
started = time.perf_counter()
rows = load().count()
df = load()
df.write.jdbc(url, f'"{schema}".ledger_events', mode="append", properties=props)
seconds = time.perf_counter() - started
print("JDBC " + json.dumps({"mode": "spark_jdbc", "spec": "LEDGER_EVENTS_ONLY", "rows": rows,
      "seconds": round(seconds, 3), "rows_per_second": round(rows / seconds)}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=50_000, help="maxOffsetsPerTrigger")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "sink_throughput.json"))
    args = parser.parse_args()
    subprocess.run([str(ROOT / "scripts" / "stack.sh"), "start"], check=True, stdout=subprocess.DEVNULL)
    stack = read_env_file(ROOT / ".local" / "stack.env")
    os.environ.update(stack)
    tag = time.strftime("%H%M%S")
    tmp = Path("/tmp") / f"eos-bench-{tag}"
    tmp.mkdir(parents=True)
    topic = f"bench.ledger.{tag}"
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=4)
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], args.events, topic=topic, batch_size=5000, seed=42)

    results = []
    for delivery, spec in [("at_least_once", "LEDGER"), ("exactly_once", "LEDGER"), ("two_phase", "LEDGER"),
                           ("at_least_once", "LEDGER_EVENTS_ONLY"), ("idempotent", "LEDGER_EVENTS_ONLY"),
                           ("exactly_once", "LEDGER_EVENTS_ONLY")]:
        name = f"b{tag}{delivery[:3]}{spec[-4:].lower()}"
        results.append(run_mode(stack, tmp, topic, name, delivery, f"spark_apps.ledger.spec:{spec}", args.batch))
        print(json.dumps(results[-1]))
    results.append(raw_copy(stack, topic, args.events, f"rawcopy{tag}"))
    print(json.dumps(results[-1]))
    jdbc_schema = f"jdbc{tag}"
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        run_ddl(cur, ledger_ddl(jdbc_schema))
    conn.close()
    results.append(spark_jdbc(stack, topic, jdbc_schema, tmp))
    print(json.dumps(results[-1]))

    def rate(mode: str, spec: str) -> float:
        # Warm rates: the JDBC peer warms its JVM up before its clock starts, so
        # the sink's modes are compared without their first (warm-up) batch too.
        row = next(r for r in results if r["mode"] == mode and r["spec"] == spec)
        return row.get("warm_rows_per_second") or row["rows_per_second"]

    ratios = {
        "exactly_once_vs_at_least_once (ledger, both targets)":
            round(rate("exactly_once", "LEDGER") / rate("at_least_once", "LEDGER"), 3),
        "two_phase_vs_exactly_once (ledger, both targets)":
            round(rate("two_phase", "LEDGER") / rate("exactly_once", "LEDGER"), 3),
        "exactly_once_vs_at_least_once (events only)":
            round(rate("exactly_once", "LEDGER_EVENTS_ONLY") / rate("at_least_once", "LEDGER_EVENTS_ONLY"), 3),
        "exactly_once_vs_raw_copy (events only)":
            round(rate("exactly_once", "LEDGER_EVENTS_ONLY") / rate("raw_copy", "LEDGER_EVENTS_ONLY"), 3),
        "exactly_once_vs_spark_jdbc (events only)":
            round(rate("exactly_once", "LEDGER_EVENTS_ONLY") / rate("spark_jdbc", "LEDGER_EVENTS_ONLY"), 3),
    }
    report = {"events": args.events, "max_offsets_per_trigger": args.batch, "machine": machine(),
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results, "ratios": ratios}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'mode':<16}{'spec':<22}{'rows':>9}{'seconds':>10}{'rows/s':>10}{'warm rows/s':>12}")
    for r in results:
        print(f"{r['mode']:<16}{r['spec']:<22}{r['rows']:>9}{r['seconds']:>10}{r['rows_per_second']:>10}"
              f"{r.get('warm_rows_per_second') or '':>12}")
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
