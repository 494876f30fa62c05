"""What every benchmark here shares: the machine it ran on, the local stack,
one fresh ledger topic to read, and how a side-by-side bench runs two checkouts in turn."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.harness import STATE_DIR, kafka_connect_connection, read_env_file
from spark_apps.ledger.generator import ensure_topic, produce_ledger

ROOT = Path(__file__).resolve().parents[1]
PARTITIONS = 4


def drop_schemas(conn: Any, *schemas: str) -> None:
    """DROP SCHEMA ... CASCADE of each, committed."""
    from psycopg2 import sql

    with conn.cursor() as cur:
        for schema in schemas:
            cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    conn.commit()


def fresh_ledger_schemas(conn: Any, meta: str, target: str) -> None:
    """Empty schemas for one exactly_once ledger pipeline: its meta tables and its targets."""
    from spark_apps.eos_stream.run import preflight
    from spark_apps.eos_stream.sink.modes import MODES
    from spark_apps.ledger.spec import LEDGER

    drop_schemas(conn, meta, target)
    preflight.ensure_meta_tables(conn, meta)
    preflight.create_targets(conn, LEDGER, target, MODES["exactly_once"])


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kb = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal")))
    pg_version = subprocess.run(["psql", "--version"], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version(), "postgres_client": pg_version}


def local_stack() -> dict[str, str]:
    """Starts the local stack if it is down; its settings, also put into this process's environment."""
    subprocess.run([str(ROOT / "scripts" / "stack.sh"), "start"], check=True, stdout=subprocess.DEVNULL)
    stack = read_env_file(STATE_DIR / "stack.env")
    os.environ.update(stack)
    return stack


CONNECT_CONN = "eos_bench_connect"  # the Airflow connection to the Connect worker a bench sets


def connect_stack(conn_id: str = CONNECT_CONN) -> dict[str, str]:
    """The local stack with its Kafka Connect worker started (if it is down), and an Airflow
    connection ``conn_id`` to the worker's REST API in this process's environment, for
    ``KafkaConnectHook``; the stack's settings, the worker's URL and secrets files included."""
    local_stack()
    subprocess.run([str(ROOT / "scripts" / "stack.sh"), "start-connect"], check=True, stdout=subprocess.DEVNULL)
    stack = local_stack()  # now with the Connect worker's URL
    os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = kafka_connect_connection(stack)
    return stack


def git_commit(tree: Path) -> str:
    """The short commit a checkout is at ("unknown" outside git), with ``-dirty`` when its tracked
    files differ from that commit: which build a figure is of."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commit = done.stdout.strip()
    if not commit:
        return "unknown"
    changed = subprocess.run(["git", "-C", str(tree), "diff", "--quiet", "HEAD", "--"], capture_output=True)
    return f"{commit}-dirty" if changed.returncode == 1 else commit


def end_offsets_sum(batch: dict[str, Any], topics: Collection[str] | None = None) -> int:
    """The sum of a ``batch`` event's end offsets (its nested JSON of topic, partition and
    offset), over ``topics`` only when given."""
    return sum(offset for topic, partitions in json.loads(batch["end_offsets"]).items()
               if topics is None or topic in topics for offset in partitions.values())


def linear_at(samples: Sequence[tuple[float, float]], moment: float) -> float:
    """The value at ``moment`` of (time, value) ``samples`` in time order: linear between the
    samples around it, the first's or the last's outside them."""
    before = max((s for s in samples if s[0] <= moment), default=samples[0])
    after = min((s for s in samples if s[0] >= moment), default=samples[-1])
    if after[0] <= before[0]:
        return float(before[1])
    return before[1] + (after[1] - before[1]) * (moment - before[0]) / (after[0] - before[0])


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages: how busy the machine was around a figure."""
    return [round(x, 2) for x in os.getloadavg()]


def side_by_side_parser(description: str, output: str) -> argparse.ArgumentParser:
    """The options of a bench that runs this checkout and ``--baseline`` in turn: ``--runs``,
    ``--baseline`` and ``--output`` (default ``bench/results/<output>``); the bench adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout (e.g. a git worktree)")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / output))
    return parser


def in_turn(labels: list[str], runs: int) -> Iterator[tuple[int, str]]:
    """(run, label) for ``runs`` runs of every label, alternating which goes first, so neither
    checkout always runs on a machine the other just warmed or loaded."""
    for index in range(runs):
        for label in (labels if index % 2 == 0 else labels[::-1]):
            yield index, label


def side_by_side_report(trees: dict[str, Path], runs: int, load_at_start: list[float]) -> dict[str, Any]:
    """What a side-by-side bench's result file records besides its figures: the command, each
    checkout's commit, the machine and its load at the start and now."""
    return {"command": " ".join([Path(sys.argv[0]).resolve().relative_to(ROOT).as_posix(), *sys.argv[1:]]),
            "commits": {label: git_commit(tree) for label, tree in trees.items()}, "machine": machine(),
            "runs": runs, "load_average_at_start": load_at_start, "load_average_at_end": load_average()}


def ledger_topic(stack: dict[str, str], kind: str, events: int) -> tuple[str, str]:
    """A new topic ``bench.<kind>.<tag>`` of ``events`` ledger events, committed in transactions of
    5,000 over PARTITIONS partitions; returns (topic, tag)."""
    tag = time.strftime("%H%M%S")
    topic = f"bench.{kind}.{tag}"
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=PARTITIONS)
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], events, topic=topic, batch_size=5000, seed=42)
    return topic, tag
