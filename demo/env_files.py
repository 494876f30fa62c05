"""The env files the local stack's scripts write (``.local/stack.env``,
``.local/airflow.env``: ``export KEY=value`` lines), read back into a dict.

One reader for the demo, the tests and the benchmarks."""

from __future__ import annotations

from pathlib import Path


def read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export "):].partition("=")
            env[key] = value.strip("'\"")
    return env
