"""What ``make demo`` shows on the terminal: one line per stage, a progress bar while it waits,
and the report. Everything else a process would write there (Python's logging, librdkafka's
lines, a child process's stderr) goes to one log file, named at the end of the report; a failed
task's log goes to a file of its own, and the report shows one line of it."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

# Lines of a task's log that say why it failed, most telling first.
# A raised exception as Python prints it ("AirflowException: ..."): the cause itself.
_RAISED = re.compile(r"\b\w*(?:Error|Exception|Timeout)\w*: \S")
# Else a line that speaks of a failure. Airflow's own closing lines ("emitted OpenLineage `FAIL`
# event") come after the cause, so the raised exception is looked for first.
_CAUSE = re.compile(r"\b\w*(?:Error|Exception)\b|\bfailed\b|\bFAIL\b|\bERROR\b", re.IGNORECASE)


class Console:
    """One line per stage; a progress bar while waiting (a plain line per 15 s off a terminal)."""

    def __init__(self, total: int, out: TextIO | None = None) -> None:
        self.total, self.index, self.started = total, 0, time.monotonic()
        self.out = out or sys.stdout
        self.tty = self.out.isatty()
        self._last_plain = 0.0

    def stage(self, text: str) -> None:
        self.index += 1
        print(f"[{self.index:>2}/{self.total}] {time.monotonic() - self.started:6.1f}s  {text}", file=self.out,
              flush=True)

    def note(self, text: str) -> None:
        """A line within the current stage."""
        print(f"        {text}", file=self.out, flush=True)

    def waiting(self, what: str, elapsed: float, budget: float) -> None:
        if self.tty:
            filled = int(30 * min(elapsed / budget, 1.0))
            print(f"\r        [{'#' * filled}{'.' * (30 - filled)}] {elapsed:5.0f}s {what}   ", end="",
                  file=self.out, flush=True)
        elif elapsed - self._last_plain >= 15:
            self._last_plain = elapsed
            print(f"        ... {what}: {elapsed:.0f}s", file=self.out, flush=True)

    def done_waiting(self) -> None:
        if self.tty:
            print("\r" + " " * 78 + "\r", end="", file=self.out, flush=True)
        self._last_plain = 0.0


def quiet_console(log_file: Path) -> TextIO:
    """Sends this process's stderr (file descriptor 2, which child processes and librdkafka's own
    threads write to as well) and Python's logging to ``log_file``, so that the terminal shows the
    stages and the report only.

    :returns: the terminal's stderr, for an error that must still reach the user."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    # Open for the life of the process: file descriptor 2 points at it from here on.
    log = open(log_file, "a", buffering=1)
    os.dup2(log.fileno(), 2)
    sys.stderr = log
    logging.basicConfig(stream=log, level=logging.INFO, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return terminal


def failure_summary(log_lines: list[str]) -> str:
    """One line that says why a task failed: the last exception its log shows raised, else the last
    line naming an error, else its last line."""
    # An entry read through Airflow's API may hold several lines (an exception's message does):
    # the summary is one physical line.
    lines = [line.strip() for entry in log_lines for line in entry.splitlines() if line.strip()]
    if not lines:
        return "(its log is empty)"
    raised = [line for line in lines if _RAISED.search(line)]
    telling = [line for line in lines if _CAUSE.search(line)]
    line = (raised or telling or lines)[-1]
    return line if len(line) <= 160 else line[:157] + "..."


def save_task_log(folder: Path, dag_id: str, task_id: str, lines: list[str]) -> Path:
    """Writes a failed task's log where the report can point to it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dag_id}.{task_id}.log"
    path.write_text("\n".join(lines) + "\n")
    return path


def _section(out: TextIO, title: str) -> None:
    print(f"\n================ {title} ================", file=out)


def _rows(out: TextIO, rows: dict[str, Any], expand: bool = False) -> None:
    """``key: value`` lines; with ``expand``, a dict value gets a line per entry."""
    for key, value in rows.items():
        if expand and isinstance(value, dict):
            print(f"{key:>32}:", file=out)
            for inner, detail in value.items():
                print(f"{inner:>32}  {detail}", file=out)
        else:
            print(f"{key:>32}: {value}", file=out)


def _mirror_rows(out: TextIO, mirror: dict[str, Any]) -> None:
    """The mirror's report: its faults, then each mirror table against its source and the
    aggregate against its GROUP BY, in rows that differ (EXCEPT ALL both ways)."""
    _section(out, "report: shop_mirror (a change stream)")
    _rows(out, {k: v for k, v in mirror.items() if k not in ("tables", "aggregate", "exact")})
    for table, seen in mirror["tables"].items():
        print(f"{table + ' vs its source':>32}: {seen['source_rows']} rows, rows that differ: {seen['differ']}",
              file=out)
    aggregate = mirror["aggregate"]
    print(f"{aggregate['table'] + ' vs GROUP BY ' + aggregate['group_by']:>32}: {aggregate['groups']} groups, "
          f"rows that differ: {aggregate['differ']}", file=out)
    print(f"{'exact':>32}: {mirror['exact']}", file=out)


def print_report(result: dict[str, Any], downstream: str, out: TextIO | None = None) -> None:
    """The terminal's report of the three pipelines, the Spark applications, the assets and the lineage."""
    out = out or sys.stdout
    _section(out, "report: ledger")
    _rows(out, {k: v for k, v in result.items()
                if k not in ("orders", "mirror", "exact", "spark", "assets", "lineage")})
    _section(out, "report: orders")
    _rows(out, result["orders"], expand=True)
    _mirror_rows(out, result["mirror"])
    print(f"\n{'all three pipelines exact':>32}: {result['exact']}", file=out)
    print(f"{'spark master':>32}: {result['spark']['master']}", file=out)
    for app in result["spark"]["applications"]:
        print(f"{app['id']:>32}  {app['name']} ({app['cores']} core(s), {app['state']})", file=out)
    for dag_id, ui in result["spark"]["driver_ui"].items():
        print(f"{'Spark driver UI of ' + dag_id:>32}: {ui['link']} (served while the stream ran: {ui['serves']})",
              file=out)
    assets = result["assets"]
    _section(out, "assets: the ledger's targets")
    print(f"{'target assets':>32}: {', '.join(assets['target_assets'])}", file=out)
    print(f"{'asset events (per target)':>32}: {assets['changes']}", file=out)
    last = [e for e in assets["events"] if e["from_trigger"]][-1:]
    if last:
        print(f"{'last: target holds all below':>32}: {last[0]['offsets']}", file=out)
    print(f"{downstream:>32}: runs {assets['downstream_runs']}, told of {assets['downstream_told']} event(s)",
          file=out)
    _section(out, "lineage (OpenLineage file transport)")
    for job, seen in result["lineage"]["jobs"].items():
        print(f"{job:>32}: {', '.join(seen['inputs'])} -> {', '.join(seen['outputs']) or '(reads only)'}", file=out)
        for dataset, checks in seen["quality"].items():
            print(f"{'':>32}  {dataset}: {checks}", file=out)
