"""The Spark-less replay of this checkout and of another, in turn, on one clock.

    .venv/bin/python bench/direct_replay_ab.py --events 20000 200000 --runs 3 --baseline /tmp/before

Per size N: produce N ledger events into a 4-partition topic, then ``--runs`` times replay the
whole topic with each checkout's ``spark_apps.eos_stream.engines.direct_replay`` into a pipeline of its
own (fresh schemas, as a recovery's replay after the restore: nothing applied past the
snapshot), alternating which goes first; each replay is a fresh Python process with that
checkout first on ``PYTHONPATH``, timed from its start to its exit. ``max_offsets_per_trigger``
is the recovery bench's (``max(20000, N)`` there for a replay of N/5, so N here), so a replay
is as many batches as the recovery's. Medians go to bench/results/direct_replay_ab.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import in_turn, load_average, local_stack, side_by_side_parser, side_by_side_report  # noqa: E402
from bench.harness import ledger_rows, pipeline_config  # noqa: E402
from spark_apps.ledger.generator import ensure_topic, produce_ledger  # noqa: E402


def _replay(tree: Path, config: dict[str, Any], tmp: Path) -> float:
    path = tmp / f"{config['pipeline']}.json"
    path.write_text(json.dumps(config))
    clock = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "spark_apps.eos_stream.engines.direct_replay", "--config", str(path)],
                          capture_output=True, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          timeout=900)
    seconds = time.monotonic() - clock
    if done.returncode != 0:
        raise RuntimeError(f"replay by {tree} failed ({done.returncode}): {done.stderr[-3000:]}")
    return round(seconds, 3)


def main() -> None:
    parser = side_by_side_parser(__doc__ or "", "direct_replay_ab.json")
    parser.add_argument("--events", type=int, nargs="+", default=[20_000, 200_000])
    args = parser.parse_args()

    stack = local_stack()
    os.environ["PGPASSWORD"] = stack["EOS_PG_PASSWORD"]
    trees = {"this": ROOT, "baseline": args.baseline.resolve()}
    sizes = []
    load_at_start = load_average()
    with tempfile.TemporaryDirectory(prefix="eos-bench-replay-") as folder:
        tmp = Path(folder)
        for events in args.events:
            topic = f"ledger.rab{uuid.uuid4().hex[:8]}"
            ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=4)
            produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], events, topic=topic, batch_size=5000, seed=1,
                           transactional_id=f"p{topic}")
            seconds: dict[str, list[float]] = {label: [] for label in trees}
            for index, label in in_turn(list(trees), args.runs):
                name = f"rab{uuid.uuid4().hex[:8]}"
                config = pipeline_config(stack, tmp, name, topics=[topic], max_offsets_per_trigger=max(20_000, events))
                seconds[label].append(_replay(trees[label], config, tmp))
                assert ledger_rows(stack, config["target_schema"]) == events
                print(f"{events} run {index} {label}: {seconds[label][-1]} s", flush=True)
            medians = {label: statistics.median(values) for label, values in seconds.items()}
            sizes.append({"events": events, "seconds": seconds, "medians": medians,
                          "this_vs_baseline": round(medians["this"] / medians["baseline"], 3)})
    out = {**side_by_side_report(trees, args.runs, load_at_start), "sizes": sizes}
    Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    for size in sizes:
        print(size["events"], size["medians"], "this / baseline:", size["this_vs_baseline"])


if __name__ == "__main__":
    main()
