"""The restore of one snapshot by this checkout and by another, in turn, on one clock.

    .venv/bin/python bench/restore_overlap.py --events 1000000 --runs 3 --baseline /tmp/before

Builds one pipeline's state without Spark (produce N ledger events, the direct replay applies
them), snapshots it (``SnapshotOperator``), then restores that snapshot ``--runs`` times with
each checkout's ``RestoreOperator``, alternating which goes first, each in a fresh Python
process whose ``PYTHONPATH`` puts that checkout first. The scratch validation runs beside the
swap instead of before it; a baseline checkout from before that change shows what it gained
on this machine. Medians of the wall clock and of the restore's own phase timings go to
bench/results/restore_overlap.json with the machine and the load average. The stack is read
from ``$EOS_STATE_DIR/stack.env`` (default ``.local``), as ``bench/recovery_times.py`` does.
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
from bench.harness import pipeline_config, run_direct_replay  # noqa: E402
from bench.recovery_times import KAFKA_CONN, PG_CONN, _connections  # noqa: E402
from spark_apps.ledger.generator import ensure_topic, produce_ledger  # noqa: E402

# What one restore process runs: the checkout first on PYTHONPATH decides whose code restores.
_RESTORE = """
import json, sys, time
from airflow_provider_eos.hooks.pg_tools import PgToolsHook
from airflow_provider_eos.operators.restore import RestoreOperator
try:
    from airflow_provider_eos.state.stop_requests import set_stop_request
except ImportError:  # a checkout whose hook still holds its queries
    def set_stop_request(hook, pipeline, requested):
        return hook.set_stop_request(pipeline, requested)
args = json.loads(sys.argv[1])
set_stop_request(PgToolsHook(postgres_conn_id=args["pg"], meta_schema=args["meta"]), args["pipeline"], True)
clock = time.monotonic()
result = RestoreOperator(task_id="restore", snapshot_store=args["store"], quiet_seconds=0, release_lock=True,
                         kafka_config_id=args["kafka"], pipeline_config=args["config"],
                         postgres_conn_id=args["pg"]).execute({"run_id": args["run_id"]})
print("RESTORED " + json.dumps({"seconds": round(time.monotonic() - clock, 3), "timings": result["timings"]}))
"""


def _restore(tree: Path, args: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", _RESTORE, json.dumps(args)], capture_output=True, text=True,
                          cwd=tree, env=env, timeout=900)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESTORED ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"restore by {tree} failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(line[len("RESTORED "):])


def _median_phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = sorted({k for run in runs for k in run["timings"]})
    return {k: round(statistics.median(run["timings"].get(k, 0.0) for run in runs), 3) for k in keys}


def main() -> None:
    parser = side_by_side_parser(__doc__ or "", "restore_overlap.json")
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()

    stack = local_stack()
    os.environ["PGPASSWORD"] = stack["EOS_PG_PASSWORD"]
    _connections(stack)
    from airflow_provider_eos.operators.snapshot import SnapshotOperator

    with tempfile.TemporaryDirectory(prefix="eos-bench-restore-") as folder:
        tmp = Path(folder)
        name = f"rst{uuid.uuid4().hex[:8]}"
        config = pipeline_config(stack, tmp, name, max_offsets_per_trigger=200_000)
        config_file = tmp / f"{name}.json"
        config_file.write_text(json.dumps(config))
        ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=4)
        produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], args.events, topic=config["topics"][0], batch_size=5000,
                       seed=1, transactional_id=f"a{name}")
        replayed = run_direct_replay(config, tmp, timeout=1800)
        assert replayed.returncode == 0, replayed.stderr[-3000:]
        store = tmp / "store"
        snap = SnapshotOperator(task_id="snapshot", snapshot_store=str(store), keep_last=2,
                                pipeline_config=str(config_file), postgres_conn_id=PG_CONN).execute({})
        trees = {"this": ROOT, "baseline": args.baseline.resolve()}
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
        load_at_start = load_average()
        for index, label in in_turn(list(trees), args.runs):
            result = _restore(trees[label], {
                "pg": PG_CONN, "kafka": KAFKA_CONN, "meta": config["meta_schema"], "pipeline": name,
                "store": str(store), "config": str(config_file), "run_id": f"bench-{label}-{index}"})
            print(f"run {index} {label}: {result['seconds']} s {result['timings']}", flush=True)
            runs[label].append(result)
            time.sleep(1)
    medians = {label: {"seconds": round(statistics.median(r["seconds"] for r in rs), 3),
                       "phases": _median_phases(rs)} for label, rs in runs.items()}
    out = {
        **side_by_side_report(trees, args.runs, load_at_start), "events": args.events,
        "snapshot_rows": snap["total_rows"], "medians": medians,
        "runs_seconds": {label: [r["seconds"] for r in rs] for label, rs in runs.items()},
        "this_vs_baseline": round(medians["this"]["seconds"] / medians["baseline"]["seconds"], 3),
    }
    Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(medians, indent=2))
    print(f"this / baseline: {out['this_vs_baseline']}")


if __name__ == "__main__":
    main()
