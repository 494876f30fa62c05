"""What every benchmark here shares: the machine it ran on, the local stack,
and one fresh ledger topic to read."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from demo.env_files import read_env_file
from spark_apps.ledger.generator import ensure_topic, produce_ledger

ROOT = Path(__file__).resolve().parents[1]
# Where scripts/stack.sh keeps its state and writes stack.env.
STATE_DIR = Path(os.environ.get("EOS_STATE_DIR", ROOT / ".local"))
PARTITIONS = 4


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


def git_commit(tree: Path) -> str:
    """The short commit a checkout is at ("unknown" outside git): which build a figure is of."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def ledger_topic(stack: dict[str, str], kind: str, events: int) -> tuple[str, str]:
    """A new topic ``bench.<kind>.<tag>`` of ``events`` ledger events, committed in transactions of
    5,000 over PARTITIONS partitions; returns (topic, tag)."""
    tag = time.strftime("%H%M%S")
    topic = f"bench.{kind}.{tag}"
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=PARTITIONS)
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], events, topic=topic, batch_size=5000, seed=42)
    return topic, tag
