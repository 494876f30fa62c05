"""Benchmarks: scripts run by hand, results in bench/results (docs/benchmarks.md)."""
