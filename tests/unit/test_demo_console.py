"""``make demo``'s console: a failed task shows as one line and a path, never its raw log."""

from __future__ import annotations

import io
from pathlib import Path

from demo.console import failure_summary, print_report, save_task_log

HEALTH_LOG = [
    "INFO Task started",
    "INFO poking: partitions [0, 1]",
    "WARNING partition ledger.events[2]: LSO 120 stuck for 31 s",
    "ERROR Task failed with exception",
    "  AirflowException: Kafka partitions with a stuck last stable offset: ledger.events[2] (31 s)",
    "INFO Task instance in failure state",
]


def test_the_summary_is_the_last_line_that_names_the_error() -> None:
    assert failure_summary(HEALTH_LOG) == (
        "AirflowException: Kafka partitions with a stuck last stable offset: ledger.events[2] (31 s)")
    assert failure_summary(["INFO all quiet", "INFO the end"]) == "INFO the end"
    assert failure_summary([]) == "(its log is empty)"
    assert len(failure_summary(["Error: " + "x" * 500])) == 160


def test_an_entry_of_several_lines_gives_one_line() -> None:
    """Airflow's API returns an exception's message with its newlines in one log entry."""
    entry = "  AirflowException: Kafka partitions with a stuck last stable offset:\nLSO lag report: 4 partition(s)"
    assert failure_summary(["INFO start", entry, "info ::endgroup::"]) == (
        "AirflowException: Kafka partitions with a stuck last stable offset:")


def test_airflows_closing_lines_do_not_hide_the_raised_exception() -> None:
    """A real health task's log ends with OpenLineage's `FAIL` event line, after the exception."""
    closing = ["info ::group::Post Execute", "info Successfully emitted OpenLineage `FAIL` event of id `01a2`",
               "info ::endgroup::"]
    assert failure_summary(HEALTH_LOG + closing) == (
        "AirflowException: Kafka partitions with a stuck last stable offset: ledger.events[2] (31 s)")


def test_the_whole_log_goes_to_a_file(tmp_path: Path) -> None:
    path = save_task_log(tmp_path / "task-logs", "eos_health__ledger", "check_lso", HEALTH_LOG)
    assert path.read_text().splitlines() == HEALTH_LOG


def _mirror(differ: int) -> dict:
    return {"source_transactions": 40, "driver_runs": 2,
            "tables": {"customers": {"source_rows": 12, "differ": 0},
                       "order_lines": {"source_rows": 7, "differ": differ}},
            "aggregate": {"table": "sku_totals", "group_by": "sku", "groups": 5, "differ": 0},
            "exact": differ == 0}


def _result(health: str, mirror_differ: int = 0) -> dict:
    return {"events_produced": 10, "health_failed_because": health, "exact": mirror_differ == 0,
            "orders": {"rows_in_db": 3, "through_the_ledger_recovery": {"stream_runs": 1}},
            "mirror": _mirror(mirror_differ),
            "spark": {"master": "local[*]", "applications": [], "driver_ui": {}},
            "assets": {"target_assets": ["postgres://t"], "changes": 2, "events": [], "downstream_runs": 1,
                       "downstream_told": 2},
            "lineage": {"jobs": {}}}


def test_the_report_prints_one_line_per_failure() -> None:
    why = f"check_lso: {failure_summary(HEALTH_LOG)} (log: .local/demo/task-logs/eos_health__ledger.check_lso.log)"
    out = io.StringIO()
    print_report(_result(why), "eos_example_downstream__ledger", out)
    text = out.getvalue()
    assert f"health_failed_because: {why}" in text
    assert "Task instance in failure state" not in text and "\\n" not in text
    assert f"{'stream_runs':>32}  1" in text  # the orders' nested section, a line per entry


def test_a_quiet_console_keeps_stderr_logging_and_children_off_the_terminal(tmp_path: Path) -> None:
    import subprocess
    import sys

    log = tmp_path / "story.log"
    script = f"""
import logging, os, subprocess, sys
from pathlib import Path
from demo.console import quiet_console
terminal = quiet_console(Path({str(log)!r}))
print("[ 1/18] a stage", flush=True)
os.write(2, b"%4|1732000000.000|FAIL|rdkafka#producer-1| a librdkafka line\\n")
logging.getLogger("eos.kafka").warning("a warning through logging")
subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('a child on stderr')"], check=True)
print("the demo stopped: why", file=terminal, flush=True)
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[ 1/18] a stage\n"
    assert done.stderr == "the demo stopped: why\n"  # what must reach the user still does
    written = log.read_text()
    assert "a librdkafka line" in written and "WARNING eos.kafka: a warning through logging" in written
    assert "a child on stderr" in written


def test_the_report_ends_with_each_mirror_table_against_its_source() -> None:
    out = io.StringIO()
    print_report(_result("", mirror_differ=0), "eos_example_downstream__ledger", out)
    text = out.getvalue()
    assert f"{'customers vs its source':>32}: 12 rows, rows that differ: 0" in text
    assert f"{'order_lines vs its source':>32}: 7 rows, rows that differ: 0" in text
    assert f"{'sku_totals vs GROUP BY sku':>32}: 5 groups, rows that differ: 0" in text
    assert f"{'source_transactions':>32}: 40" in text and "'tables'" not in text
    out = io.StringIO()
    print_report(_result("", mirror_differ=3), "eos_example_downstream__ledger", out)
    assert f"{'order_lines vs its source':>32}: 7 rows, rows that differ: 3" in out.getvalue()
    assert f"{'all three pipelines exact':>32}: False" in out.getvalue()
