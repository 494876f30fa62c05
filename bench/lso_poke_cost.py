"""Cost of one LSO-lag poke against the real local broker.

One poke = cluster metadata (list_topics) + ListOffsets(latest, READ_UNCOMMITTED)
+ ListOffsets(latest, READ_COMMITTED) for all partitions: what LsoLagTrigger and
LastStableOffsetLagSensor do per poke. "full" adds ListOffsets(earliest).

    .venv/bin/python bench/lso_poke_cost.py [--pokes 20] [--bootstrap 127.0.0.1:19092]

Writes bench/results/lso_poke_cost.json (with a machine description).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook  # noqa: E402


def machine() -> dict[str, object]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "cpu_model": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def bootstrap_default() -> str:
    env = ROOT / ".local" / "stack.env"
    if env.exists():
        for line in env.read_text().splitlines():
            if line.startswith("export EOS_KAFKA_BOOTSTRAP="):
                return line.split("=", 1)[1].strip("'\"")
    return "127.0.0.1:19092"


def timed(fn, n: int) -> list[float]:
    fn()  # warm-up (connections, metadata cache)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default=os.environ.get("EOS_KAFKA_BOOTSTRAP") or bootstrap_default())
    parser.add_argument("--pokes", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "lso_poke_cost.json"))
    args = parser.parse_args()

    conn_id = "eos_bench_kafka"
    os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(
        {"conn_type": "kafka", "extra": {"bootstrap.servers": args.bootstrap}}
    )
    admin = AdminClient({"bootstrap.servers": args.bootstrap})
    suffix = uuid.uuid4().hex[:8]
    topics = {1: f"eos_bench_lso_1p_{suffix}", 100: f"eos_bench_lso_100p_{suffix}"}
    for fut in admin.create_topics([NewTopic(t, n, 1) for n, t in topics.items()], operation_timeout=60).values():
        fut.result(60)
    try:
        _fill(args.bootstrap, topics)
        results = _measure(KafkaOffsetsHook(kafka_config_id=conn_id), topics, args.pokes)
    finally:
        for fut in admin.delete_topics(list(topics.values()), operation_timeout=60).values():
            try:
                fut.result(60)
            except Exception as err:
                print(f"could not delete a bench topic: {err}", file=sys.stderr)

    out = {
        "benchmark": "lso_poke_cost",
        "bootstrap": args.bootstrap,
        "broker": "single-node Kafka 4.3.1 KRaft on loopback (scripts/stack.sh)",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _fill(bootstrap: str, topics: dict[int, str]) -> None:
    """A few records per partition, so offsets are not all 0."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for n, topic in topics.items():
        for p in range(n):
            for i in range(3):
                producer.produce(topic, value=f"{i}".encode(), partition=p)
    producer.flush(30)


def _measure(hook: KafkaOffsetsHook, topics: dict[int, str], pokes: int) -> list[dict]:
    """Per topic, ``pokes`` timed calls of a sensor's poke and of the full read."""
    results = []
    for n, topic in topics.items():
        hook.partition_offsets([topic])  # waits for leaders of a fresh topic
        for variant, include_earliest in (("poke", False), ("full", True)):
            samples = timed(lambda t=topic, e=include_earliest: hook.partition_offsets([t], e), pokes)
            row = {
                "partitions": n,
                "variant": variant,
                "requests": "metadata + 2 ListOffsets" if variant == "poke" else "metadata + 3 ListOffsets",
                "pokes": pokes,
                "median_ms": round(statistics.median(samples), 2),
                "p90_ms": round(sorted(samples)[int(0.9 * (len(samples) - 1))], 2),
                "min_ms": round(min(samples), 2),
                "max_ms": round(max(samples), 2),
            }
            results.append(row)
            print(
                f"{n:>4} partitions  {variant:<4}  median {row['median_ms']:7.2f} ms  "
                f"p90 {row['p90_ms']:7.2f} ms  ({row['requests']}, {pokes} pokes)"
            )
    return results


if __name__ == "__main__":
    sys.exit(main())
