"""The continuous engine (``spark_apps.eos_stream.engines.continuous``) as a child of this worker: no
Spark, no Spark hook. Its config in a private file, its secrets in its environment only, in a
process group of its own so a stop ends it and whatever it started."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from airflow_provider_eos.launchers.protocol import kill_group, secret_env, write_private_config
from airflow_provider_eos.launchers.result import AppRunResult, Event, EventLog, parse_event

if TYPE_CHECKING:
    from spark_apps.eos_stream.run.config import PipelineConfig

CONTINUOUS_MODULE = "spark_apps.eos_stream.engines.continuous"


class ChildProcessLauncher:
    """Runs ``python -m <module> --config <file>`` with this interpreter, reads its ``EOS-`` lines.

    A batch's event is folded into the previous batch's (``EventLog``): the engine commits tens of
    cycles a second. Every other output line is logged.

    :param module: the engine's module (default: the continuous engine).
    """

    def __init__(self, module: str = CONTINUOUS_MODULE, log: Any = None) -> None:
        self.module = module
        self.log = log or logging.getLogger(__name__)
        self.event_log = EventLog(fold_batches=True)
        self.process: subprocess.Popen[str] | None = None
        self.config_path: str | None = None
        self._workdir: str | None = None
        self._started = 0.0
        self._tail: list[str] = []

    def start(self, config: PipelineConfig) -> None:
        self._workdir = tempfile.mkdtemp(prefix="eos-engine-")  # mode 700: the config file's folder
        self.config_path = write_private_config(self._workdir, config)
        command = [sys.executable, "-m", self.module, "--config", self.config_path]
        self._started = time.monotonic()
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **secret_env(config)},
            start_new_session=True, bufsize=-1, universal_newlines=True, errors="replace")
        self.log.info("Started %s (pid %s): %s", self.module, self.process.pid, " ".join(command))

    def events(self) -> Iterator[Event]:
        assert self.process is not None and self.process.stdout is not None, "start() first"
        for raw in iter(self.process.stdout.readline, ""):
            event = self.on_line(raw.rstrip("\n"))
            if event is not None:
                yield event
        self.process.wait()

    def on_line(self, line: str) -> Event | None:
        """One output line: an ``EOS-`` event is recorded and returned; a batch's is not logged (one
        per cycle, tens a second), every other line is."""
        self._tail = [*self._tail[-4:], line]
        event = parse_event(line.strip())
        if event is not None:
            self.event_log.add(event)
            if event[0] == "batch":
                return event
        self.log.info("%s", line)
        return event

    def stop(self) -> None:
        kill_group(self.process, self.log)
        self._cleanup()

    def result(self) -> AppRunResult:
        assert self.process is not None, "start() first"
        returncode = self.process.wait()
        self._cleanup()
        return AppRunResult(returncode=int(returncode), events=list(self.event_log.events),
                            duration_s=round(time.monotonic() - self._started, 2), log_tail="\n".join(self._tail))

    def _cleanup(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
