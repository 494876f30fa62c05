"""Per-record cost of the mirror's executor path, without the stack: Debezium records built
in memory, run through the functions both engines call, stage by stage.

    .venv/bin/python bench/cdc_decode.py --changes 50000 --runs 3 [--schemas off] [--profile]

The records are ``bench/cdc_changes.py``'s (one table ``t00``: ``bigint``, ``text``,
``integer``, ``numeric``, ``timestamptz``, ``jsonb``; creates, updates, deletes and their
tombstones; JSON with schemas unless ``--schemas off``), in Arrow batches of ``--batch``
records of (topic, partition, offset, key, value), the form a Spark task and the continuous
engine hand to ``MirrorBatches.staging_chunks``. Each stage runs over every record and is
timed alone; a stage includes the ones above it:

* ``json``: the key's and the value's JSON parsed (``envelope._json``), nothing else;
* ``envelope``: ``envelope.parse_envelope``, the envelope read and its schemas taken;
* ``resolve``: ``patterns.Router.resolve``, routed to its target and typed (``decode_change``);
* ``stage``: ``MirrorBatches.staging_chunks``, the COPY text of every batch (what is sent to
  PostgreSQL), the Arrow batches' conversion to Python included.

A figure is records per second of one Python thread (tombstones counted: each is a record
the path reads), the median of ``--runs``, over two clocks: the wall clock and this process's
CPU time. On a loaded machine the wall clock counts the time other processes held the core;
CPU time does not, so it is the steadier figure for comparing two trees. ``--profile`` prints
cProfile's top functions of one ``stage`` run instead. Writes ``--output`` (JSON) with the machine's load average: the
figures are of a shared machine. With ``--baseline DIR`` (a checkout of another commit holding
this script), each of ``--runs`` rounds runs both trees once, in alternating order, and the
medians of both are written side by side.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cdc_changes import COLUMNS, ChangeStream  # noqa: E402
from bench.common import git_commit, load_average, machine  # noqa: E402
from spark_apps.eos_stream.cdc import envelope, patterns  # noqa: E402
from spark_apps.eos_stream.cdc.definition import parse_mirror  # noqa: E402
from spark_apps.eos_stream.cdc.pipeline import MirrorBatches  # noqa: E402
from spark_apps.eos_stream.cdc.transactions import PER_KEY, TRANSACTION_MODES  # noqa: E402

PREFIX = "bench"


def make_records(changes: int, schemas: bool, transactions: str | None = None
                 ) -> list[tuple[str, int, int, bytes, bytes | None]]:
    """(topic, partition, offset, key, value) of ``changes`` changes and their tombstones.
    ``transactions``: the changes carry Debezium's transaction metadata, as a whole mirror's
    connector writes them; with ``whole`` the transaction topic's ENDs are among the records
    (what a ``whole`` mirror reads), with ``per_key`` they are not (a ``per_key`` mirror does not)."""
    stream = ChangeStream(1, changes, prefix=PREFIX, schemas=schemas, transaction_metadata=transactions is not None,
                          begins=False)
    records = [(topic, 0, offset, key, value) for offset, (topic, key, value) in enumerate(stream.records())]
    if transactions == PER_KEY:
        records = [r for r in records if r[0] != stream.transaction_topic()]
    return records


def arrow_batches(records: list[tuple], size: int) -> list[Any]:
    import pyarrow as pa

    schema = pa.schema([("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()),
                        ("key", pa.binary()), ("value", pa.binary())])
    return [pa.RecordBatch.from_pylist([dict(zip(schema.names, r, strict=True)) for r in records[i:i + size]],
                                       schema=schema) for i in range(0, len(records), size)]


def batches_of_definition(transactions: str | None = None) -> MirrorBatches:
    return MirrorBatches(parse_mirror({"topic_prefix": PREFIX, "transactions": transactions or PER_KEY, "tables": [
        {"source": "public.t00", "key": ["id"], "columns": dict(COLUMNS)}]}))


def stages(records: list[tuple], batches: list[Any], transactions: str | None = None
           ) -> dict[str, Callable[[], int]]:
    """Each stage as a function over every record, returning a count that keeps its work alive.
    A ``whole`` mirror's ``stage`` counts the records' transaction groups as its stagers do."""
    mirror = batches_of_definition(transactions)
    router = patterns.Router(mirror.definition)
    records = [r for r in records if r[0] != mirror.transaction_topic()]  # only ``stage`` reads the ENDs

    def json_only() -> int:
        return sum(envelope._json(v, "value") is not None and envelope._json(k, "key") is not None
                   for _, _, _, k, v in records if v is not None)

    def envelope_only() -> int:
        return sum(envelope.parse_envelope(k, v) is not None for _, _, _, k, v in records)

    def resolve() -> int:
        return sum(router.resolve(k, v) is not None for _, _, _, k, v in records)

    def stage() -> int:
        return sum(len(chunk) for chunk in mirror.staging_chunks(batches, keep_raw=False,
                                                                  counter=mirror.group_counter()))

    return {"json": json_only, "envelope": envelope_only, "resolve": resolve, "stage": stage}


def timed(run: Callable[[], int]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one run."""
    started, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - started, time.process_time() - cpu


def side_by_side(args: argparse.Namespace) -> None:
    """``--runs`` rounds, each one run of this tree and one of ``--baseline`` (a checkout of
    another commit, given this script), in alternating order: both see the same load."""
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
    trees = {"baseline": args.baseline, "this": ROOT}
    for round_ in range(args.runs):
        for label in (("baseline", "this") if round_ % 2 == 0 else ("this", "baseline")):
            out = Path(tempfile.mkdtemp()) / "run.json"
            subprocess.run([sys.executable, str(trees[label] / "bench/cdc_decode.py"), "--changes", str(args.changes),
                            "--batch", str(args.batch), "--runs", "1", "--schemas", args.schemas, "--output",
                            str(out)], check=True, cwd=trees[label])
            runs[label].append(json.loads(out.read_text()))
    report: dict[str, Any] = {"command": " ".join(["bench/cdc_decode.py", *sys.argv[1:]]), "machine": machine(),
                              "changes": args.changes, "schemas": args.schemas, "runs": args.runs}
    for label, results in runs.items():
        records = results[0]["records"]
        report[label] = {"commit": results[0]["commit"], "records": records,
                         "mean_record_bytes": results[0]["mean_record_bytes"],
                         "load_average": [r["load_average"] for r in results]}
        for clock, key in (("records_per_second", "seconds"), ("records_per_cpu_second", "cpu_seconds")):
            report[label][clock] = {name: round(records / statistics.median(r[key][name][0] for r in results))
                                    for name in results[0][key]}
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    before, after = report["baseline"], report["this"]
    for name, rate in after["records_per_cpu_second"].items():
        print(f"{name:>9}: {before['records_per_cpu_second'][name]:>9,} -> {rate:>9,} records/CPU-s, "
              f"{before['records_per_second'][name]:>9,} -> {after['records_per_second'][name]:>9,} records/s (wall)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=5_000, help="records per Arrow batch")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--schemas", choices=("on", "off"), default="on")
    parser.add_argument("--transactions", choices=TRANSACTION_MODES,
                        help="the changes carry transaction metadata, and the mirror applies them so (a whole "
                             "mirror's records include the transaction topic's ENDs); unset: no metadata")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--label", default="", help="what this tree is, in the results")
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/cdc_decode.json")
    parser.add_argument("--baseline", type=Path, help="a checkout to compare with, run in alternation")
    args = parser.parse_args()
    if args.baseline is not None:
        side_by_side(args)
        return
    records = make_records(args.changes, args.schemas == "on", args.transactions)
    batches = arrow_batches(records, args.batch)
    run = stages(records, batches, args.transactions)
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(run["stage"])
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return
    load_at_start = load_average()
    seconds: dict[str, list[float]] = {name: [] for name in run}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in run}
    for _ in range(args.runs):
        for name, stage in run.items():  # in turn, so a burst of load falls on every stage alike
            wall, cpu = timed(stage)
            seconds[name].append(round(wall, 3))
            cpu_seconds[name].append(round(cpu, 3))
    size = sum(len(r[3]) + len(r[4] or b"") for r in records)
    rates = {name: round(len(records) / statistics.median(s)) for name, s in seconds.items()}
    cpu_rates = {name: round(len(records) / statistics.median(s)) for name, s in cpu_seconds.items()}
    report = {"command": " ".join(["bench/cdc_decode.py", *sys.argv[1:]]), "commit": git_commit(ROOT),
              "label": args.label, "machine": machine(), "load_average": {"start": load_at_start,
                                                                         "end": load_average()},
              "records": len(records), "changes": args.changes, "schemas": args.schemas,
              "transactions": args.transactions,
              "mean_record_bytes": round(size / len(records)), "batch": args.batch, "runs": args.runs,
              "seconds": seconds, "cpu_seconds": cpu_seconds, "records_per_second": rates,
              "records_per_cpu_second": cpu_rates}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    for name, rate in rates.items():
        print(f"{name:>9}: {rate:>9,} records/s (wall), {cpu_rates[name]:>9,} records/CPU-s")


if __name__ == "__main__":
    main()
