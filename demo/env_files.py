"""The env files the local stack's scripts write (``.local/stack.env``,
``.local/airflow.env``: ``export KEY=value`` lines), read back into a dict, and where those files are.

One reader for the demo, the tests and the benchmarks: it lives in ``bench.harness``, since the
benchmarks import nothing of the demo."""

from __future__ import annotations

from bench.harness import STATE_DIR, read_env_file

__all__ = ["STATE_DIR", "read_env_file"]
