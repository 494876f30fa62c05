"""The env files the local stack's scripts write (``.local/stack.env``,
``.local/airflow.env``: ``export KEY=value`` lines), read back into a dict.

One reader for the demo, the tests and the benchmarks, and where those files are."""

from __future__ import annotations

import os
from pathlib import Path

# Where scripts/stack.sh and scripts/airflow.sh keep their state and write their env files
# (scripts/config.sh: $EOS_STATE_DIR, default .local in the checkout).
STATE_DIR = Path(os.environ.get("EOS_STATE_DIR", Path(__file__).resolve().parents[1] / ".local"))


def read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export "):].partition("=")
            env[key] = value.strip("'\"")
    return env
