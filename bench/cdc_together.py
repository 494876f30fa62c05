"""What whole source transactions cost, with the ``per_key`` mirror and the ``whole`` one
running at the same time, on the same change topics, each into its own schemas:

    .venv/bin/python bench/cdc_together.py --changes 1000000 --rounds 3 [--engine continuous]

On a shared host the machine's speed drifts by a third within minutes, and the CPU seconds
with it (``bench/cdc_throughput.py``'s busy clock tracks its wall clock), so two runs one after
the other compare two machines. Two mirrors running together see the same machine at every
moment; each gets about half of it. A round starts both (which one first alternates by
round), then compares their rates over the window in which both run warm: from the later of
their first commits to the earlier of their last. A mirror's progress at a moment is the change
topics' records read through its last commit, linear between commits; its rate is its progress
over the window; the cost is ``1 - whole rate / per_key rate``. The ENDs the ``whole`` mirror
reads are its extra work, not counted as progress. Each mirror's target is compared with the
stream's final rows; a round with a wrong mirror stops the bench.

The rates also depend on how the scheduler shares the cores between the two, so each round
also gives each mirror's CPU (its processes and its PostgreSQL backends: ``bench.pair_cpu``) per
change record read from the later of their fourth commits (the JVM of the one started second
still compiles after its first), and the **work cost**, ``1 - per_key's CPU a record /
whole's``: the rate cost of a mirror that has the machine to itself and keeps it busy, with the
drift taken out as for the rates (the broker's work for each is not in it).

This measures the work a change costs each mode under contention, not a mirror's speed alone:
``cdc_throughput`` gives that. With ``--baseline DIR`` (a checkout of another commit) the pair
is that checkout's ``whole`` mirror and this one's, and the cost is this build's against it
(negative: faster). Writes ``--out`` (JSON) and prints each round's cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cdc_changes import ChangeStream  # noqa: E402
from bench.cdc_throughput import continuous_records, produce, run_mirror  # noqa: E402
from bench.common import git_commit, linear_at, load_average, local_stack, machine  # noqa: E402
from bench.pair_cpu import OTHER, PairCpu  # noqa: E402

# The work cost's window opens at the later of the mirrors' fourth commits: a mirror's JVM is likely
# still compiling after its first (C1's threads: ~3 CPU s a start), and the mirror that started
# second paid that inside a window opened at its first commit (two builds of nearly the same
# whole mirror: the one started second used 9, 1 and 9 % more CPU a record in three rounds).
WARM_COMMITS = 3
Commits = list[tuple[float, int]]  # (commit time, the change topics' records read through it)
Contender = tuple[str, str, Path]  # its name, its ``transactions``, the checkout it runs
BASELINE = "whole@baseline"


def contenders(baseline: Path | None) -> list[Contender]:
    """The pair a round runs, the reference first."""
    if baseline is None:
        return [("per_key", "per_key", ROOT), ("whole", "whole", ROOT)]
    return [(BASELINE, "whole", baseline), ("whole", "whole", ROOT)]


def window_rates(runs: dict[str, Commits]) -> dict[str, Any]:
    """Each contender's rate (records a second) over the window both run warm (see the module),
    and the cost of the second against the first."""
    start, end = warm_window(runs)
    rates = {name: (linear_at(c, end) - linear_at(c, start)) / (end - start) for name, c in runs.items()}
    first, second = list(runs)
    return {"window_seconds": round(end - start, 3), "rates": {m: round(r) for m, r in rates.items()},
            "cost": round(1 - rates[second] / rates[first], 3)}


def warm_window(runs: dict[str, Commits], after: int = 0) -> tuple[float, float]:
    """From the later of the contenders' first commits (or commit ``after`` + 1) to the earlier of
    their last."""
    start = max(commits[min(after, len(commits) - 1)][0] for commits in runs.values())
    end = min(commits[-1][0] for commits in runs.values())
    if end <= start:
        raise SystemExit(f"no window in which both mirrors ran warm: {start} to {end}")
    return start, end


def window_work(runs: dict[str, Commits], cpu: PairCpu, labels: dict[str, str]) -> dict[str, Any]:
    """Each contender's CPU (its processes and PostgreSQL backends, ``bench.pair_cpu``) per change
    record read from the later of their fourth commits to the earlier of their last, its share of
    that window's cores, and the work cost, ``1 - first's CPU a record / second's``: the cost in
    rate of the second on a machine of its own that it keeps busy."""
    start, end = warm_window(runs, after=WARM_COMMITS)
    seconds = {name: cpu.between(labels[name], start, end) for name in runs}
    per_record = {name: seconds[name] / (linear_at(c, end) - linear_at(c, start)) for name, c in runs.items()}
    first, second = list(runs)
    other = cpu.between(OTHER, start, end)
    return {"cpu_us_per_record": {m: round(v * 1e6, 1) for m, v in per_record.items()},
            "cores": {m: round(v / (end - start), 2) for m, v in {**seconds, "other_postgres": other}.items()},
            "work_cost": round(1 - per_record[first] / per_record[second], 3)}


def one_round(args: argparse.Namespace, stack: dict[str, str], tmp: Path, stream: ChangeStream,
              produced: dict[str, int], index: int) -> dict[str, Any]:
    expected = stream.final_rows()
    results: dict[str, dict[str, Any]] = {}
    failures: list[BaseException] = []

    pair = contenders(args.baseline)
    labels = {name: f"{stream.prefix}r{index}{name.replace('_', '').replace('@', '')}" for name, _, _ in pair}

    def run(contender: Contender) -> None:
        name, mode, root = contender
        figure = "mirror_continuous" if args.engine == "continuous" else "mirror"
        figure += "_whole" if mode == "whole" else ""
        label = labels[name]
        try:
            results[name] = run_mirror(stack, tmp, stream, expected, args.batch, label, mode,
                                       continuous_records(figure, stream, produced), root, commits=True)
        except BaseException as exc:  # a SystemExit of a wrong target too: re-raised in the main thread
            failures.append(exc)

    order = pair if index % 2 == 0 else pair[::-1]
    threads = [threading.Thread(target=run, args=(contender,)) for contender in order]
    cpu = PairCpu(labels.values(), int(stack["EOS_PG_PORT"]))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu.stop()
    if failures:
        raise failures[0]
    runs = {name: [tuple(c) for c in results[name]["commits"]] for name, _, _ in pair}
    # What other_postgres was, over the whole round: PostgreSQL's own processes or a missed match.
    return {"first": order[0][0], "load_average": load_average(), **window_rates(runs),
            **window_work(runs, cpu, labels), "other_postgres_processes": cpu.other_processes()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=50_000, help="maxOffsetsPerTrigger (records)")
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", choices=("spark", "continuous"), default="spark")
    parser.add_argument("--transaction-changes", type=int, default=8)
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/cdc_together.json")
    parser.add_argument("--baseline", type=Path,
                        help="a checkout of another commit: its whole mirror against this one's")
    args = parser.parse_args()
    stack = local_stack()
    tmp = Path("/tmp") / f"eos-cdc-together-{time.strftime('%H%M%S')}"
    tmp.mkdir(parents=True)
    stream = ChangeStream(1, args.changes, prefix=f"cdct{time.strftime('%H%M%S')}", seed=args.seed, schemas=True,
                          transaction_metadata=True, transaction_changes=args.transaction_changes, begins=False)
    produced = produce(stack, stream, args.partitions)
    rounds = []
    for index in range(args.rounds):
        rounds.append(one_round(args, stack, tmp, stream, produced, index))
        print(json.dumps({"round": index, **rounds[-1]}), flush=True)
    report = {"command": " ".join(["bench/cdc_together.py", *sys.argv[1:]]), "code": git_commit(ROOT),
              "baseline_code": git_commit(args.baseline) if args.baseline else None,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
              "engine": args.engine, "changes": args.changes, "max_offsets_per_trigger": args.batch,
              "transaction_changes": f"1-{args.transaction_changes}", "transaction_begins": False,
              "converter": "JsonConverter, schemas.enable=true", "produced": produced, "rounds": rounds,
              "median_cost": statistics.median(r["cost"] for r in rounds),
              "median_work_cost": statistics.median(r["work_cost"] for r in rounds)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    pair = " against ".join(name for name, _, _ in contenders(args.baseline)[::-1])
    print(f"{pair}, {args.engine}: costs {[r['cost'] for r in rounds]}, median {report['median_cost']}; "
          f"work costs {[r['work_cost'] for r in rounds]}, median {report['median_work_cost']}")


if __name__ == "__main__":
    main()
