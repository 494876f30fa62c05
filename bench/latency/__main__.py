"""Visibility latency: from a producer's committed Kafka transaction to all of its records
visible in every target of the batch, the aggregate included.

    .venv/bin/python -m bench.latency                      # the full matrix, 3 runs each
    .venv/bin/python -m bench.latency --quick              # exactly_once and at_least_once, 0 s and 1 s, 2k/s
    .venv/bin/python -m bench.latency --deliveries exactly_once --triggers 0 --rates 2000 --runs 1
    .venv/bin/python -m bench.latency --pipelines 4 --deliveries exactly_once --triggers 0 1
    .venv/bin/python -m bench.latency --deliveries exactly_once --triggers 0 continuous --rates 2000 20000

Method (``bench/latency/probe.py``): a transactional producer (confluent-kafka) commits a
transaction every 50 ms, ledger events keyed by account, over 4 partitions, at ``--rates``
events/s, for ``--warmup`` seconds and then ``--measure`` seconds; a watcher polls the row
target and the aggregate every 20 ms. A transaction's latency is from ``commit_transaction()``
returning to the first poll that sees all of its records in both. Only transactions committed in
the measured window count. Each case is ``--runs`` runs, every run a fresh pipeline, topic and
target (spark-submit ``local[2]`` as the other benches start it: ``bench.harness.start_app``),
and its figures are the medians of its runs' p50, p90, p99 and max. ``--pipelines N`` runs N such
pipelines at once, each with its own producer and watcher; a run's figure is then the pipelines'
median, and its worst p99 is kept. Memory is the RSS of each app's process tree, sampled every
second in the measured window (driver JVM, driver Python, Python workers). Every run checks its
target holds each produced record once. Writes ``--output`` (default bench/results/latency.json)
and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, git_commit, load_average, local_stack, machine
from bench.latency.pipeline import SPECS, Case, ProbedPipeline

FIGURES = ("p50", "p90", "p99", "max")


def run_case(stack: dict[str, str], case: Case, pipelines: int, seed: int) -> dict[str, Any]:
    """One run of a case: ``pipelines`` pipelines started, probed at once, stopped."""
    with tempfile.TemporaryDirectory(prefix="eos-bench-latency-") as tmp:
        probed = [ProbedPipeline(stack, Path(tmp), case, seed + i) for i in range(pipelines)]
        results: list[dict[str, Any]] = []
        try:
            for p in probed:
                p.start()
            threads = [threading.Thread(target=p.probe) for p in probed]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for p in probed:
                if p.run is not None:
                    results.append(p.finish())
    if pipelines == 1:
        return results[0]
    merged: dict[str, Any] = {f: _median([r.get(f) for r in results]) for f in FIGURES}
    merged["worst_p99"] = max((r["p99"] for r in results if r.get("p99") is not None), default=None)
    merged["exact"] = {"ok": all(r["exact"]["ok"] for r in results)}
    kinds = {k for r in results for k, v in r.get("memory", {}).items() if isinstance(v, dict)}
    merged["memory"] = {k: {"median_mb": _median([r["memory"].get(k, {}).get("median_mb") for r in results])}
                        for k in kinds}
    merged["memory"]["total_median_mb"] = _median([r.get("memory", {}).get("total_median_mb") for r in results])
    merged["pipelines"] = results
    return merged


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 1) if present else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A case's figures: the medians of its runs."""
    summary: dict[str, Any] = {f: _median([r.get(f) for r in runs]) for f in FIGURES}
    summary["exact"] = all(r["exact"]["ok"] for r in runs)
    if runs and "memory" in runs[0]:
        for kind in ("driver_jvm", "driver_python", "python_worker", "continuous_engine", "total_median_mb"):
            values = [r["memory"].get(kind) for r in runs]
            values = [v["median_mb"] if isinstance(v, dict) else v for v in values]
            summary[f"memory_{kind.removesuffix('_median_mb')}_mb"] = _median(values)
    return summary


def cases_of(args: argparse.Namespace) -> list[Case]:
    deliveries, triggers, rates = args.deliveries, args.triggers, args.rates
    if args.quick:
        deliveries, triggers, rates = ["exactly_once", "at_least_once"], ["0", "1"], [2000]
    app = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.app)}
    spark_conf = dict(item.split("=", 1) for item in args.spark_conf)
    return [Case(d, 0.0 if t == "continuous" else float(t), r, args.warmup, args.measure, keep_logs=args.keep_logs,
                 app=app, spark_conf=spark_conf, engine="continuous" if t == "continuous" else "spark")
            for d, t, r in itertools.product(deliveries, triggers, rates)]


def _trigger(value: str) -> str:
    if value != "continuous":
        float(value)  # a Spark interval in seconds
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deliveries", nargs="+", choices=sorted(SPECS), default=sorted(SPECS))
    p.add_argument("--triggers", nargs="+", type=_trigger, default=["5", "1", "0", "continuous"],
                   help="processingTime intervals in seconds (0: as fast as it goes), or 'continuous' "
                        "(the Spark-less engine, spark_apps/eos_stream/engines/continuous.py)")
    p.add_argument("--rates", nargs="+", type=int, default=[2000, 20000], help="events per second")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--pipelines", type=int, default=1, help="pipelines streaming at once")
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--measure", type=float, default=40.0)
    p.add_argument("--quick", action="store_true",
                   help="exactly_once and at_least_once, triggers 0 s and 1 s, 2k/s (with --runs 1 and a "
                        "shorter --warmup/--measure it fits in minutes)")
    p.add_argument("--app", nargs="*", default=[], metavar="KEY=JSON",
                   help="app config keys over the bench's, e.g. driver_write_max_records=20000")
    p.add_argument("--spark-conf", nargs="*", default=[], metavar="KEY=VALUE",
                   help="spark-submit properties of the Spark cases, e.g. spark.driver.defaultJavaOptions=-Xms64m")
    p.add_argument("--keep-logs", type=Path, help="copy each app's log into this directory")
    p.add_argument("--note", default="", help="recorded with the results (e.g. what else ran on the machine)")
    p.add_argument("--output", default=str(ROOT / "bench" / "results" / "latency.json"))
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    stack = local_stack()
    document: dict[str, Any] = {
        "command": " ".join(["python -m bench.latency", *(argv if argv is not None else sys.argv[1:])]),
        "code": git_commit(ROOT), "machine": machine(), "spark_master": "local[2]",
        "method": __doc__.split("Method", 1)[1].strip() if __doc__ else "", "note": args.note,
        "pipelines": args.pipelines, "runs": args.runs, "app": args.app, "spark_conf": args.spark_conf,
        "load_average_at_start": load_average(), "cases": []}
    for case in cases_of(args):
        runs = []
        for index in range(args.runs):
            started = time.monotonic()
            result = run_case(stack, case, args.pipelines, seed=index * 100)
            result["seconds"] = round(time.monotonic() - started, 1)
            result["load_average"] = load_average()
            print(json.dumps({"delivery": case.delivery, "trigger": case.trigger_label, "rate": case.rate,
                              "run": index, **{k: v for k, v in result.items() if k != "pipelines"}}), flush=True)
            runs.append(result)
        document["cases"].append({"delivery": case.delivery, "trigger": case.trigger_label, "rate": case.rate,
                                  **summarize(runs), "runs": runs})
    document["load_average_at_end"] = load_average()
    Path(args.output).write_text(json.dumps(document, indent=2) + "\n")
    print(f"{'delivery':<14} {'trigger':>10} {'rate':>6} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7} "
          f"{'exact':>5} {'MB/pipeline':>11}")
    for c in document["cases"]:
        print(f"{c['delivery']:<14} {c['trigger']:>10} {c['rate']:>6} "
              + " ".join(f"{c[f]!s:>7}" for f in FIGURES)
              + f" {c['exact']!s:>5} {c.get('memory_total_mb')!s:>11}")


if __name__ == "__main__":
    main()
