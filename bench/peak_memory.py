"""Peak memory of the driver and the executors for one large micro-batch.

    .venv/bin/python bench/peak_memory.py --events 500000

Produces N ledger events, then runs the app (``exactly_once``, both targets,
``local[2]``, ``--driver-memory 1g``) with ``maxOffsetsPerTrigger`` = N, so
the whole topic is one batch. While it runs, the resident memory (RSS) of every process of the app's process group is
sampled every 0.1 s from /proc: the JVM (driver and, in local mode, the
executors' task threads), the Python driver and the Python workers that
parse and COPY. Memory is bounded by an Arrow batch per task, not by the
micro-batch, when these peaks do not grow with N. Writes
bench/results/peak_memory.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import ledger_topic, local_stack, machine  # noqa: E402
from bench.harness import PeakMemory, pipeline_config, start_app  # noqa: E402


def measure(stack: dict[str, str], tmp: Path, topic: str, events: int) -> dict:
    name = f"mem{time.strftime('%H%M%S')}"
    config = pipeline_config(stack, tmp, name, topics=[topic], max_offsets_per_trigger=events)
    run = start_app(config, tmp, label=name)
    memory = PeakMemory(run, 0.1)
    memory.start()
    try:
        run.wait(3600)
    finally:
        peaks = memory.stop()
    if run.process.returncode != 0:
        raise SystemExit(f"{name} failed:\n{run.log()[-3000:]}")
    batches = [e for e in run.events("batch") if e["applied"]]
    return {"batch_rows": [e["applied"] for e in batches], "batch_timings_ms": [e["timings_ms"] for e in batches],
            "peak_rss_mib": {role: round(mib) for role, mib in sorted(peaks.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=500_000)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "peak_memory.json"))
    args = parser.parse_args()
    stack = local_stack()
    topic, tag = ledger_topic(stack, "memory", args.events)
    tmp = Path("/tmp") / f"eos-mem-{tag}"
    tmp.mkdir(parents=True)
    runs = [measure(stack, tmp, topic, args.events)]
    report = {"events": args.events, "driver_memory": "1g", "master": "local[2]", "machine": machine(),
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": runs}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
