"""The direct replay (``spark_apps.eos_stream.engines.direct_replay``) in this process: no spark-submit,
no child, the same claim and sink as the app."""

from __future__ import annotations

import contextlib
import io
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from airflow_provider_eos.launchers.result import EXIT_FAILED, AppRunResult, Event, EventLog, parse_event

if TYPE_CHECKING:
    from spark_apps.eos_stream.run.config import PipelineConfig


class _EventTee(io.TextIOBase):
    """Stdout while the engine runs: each line goes on to the real stdout, its ``EOS-`` events are kept."""

    def __init__(self, target: Any, log: EventLog) -> None:
        self.target, self.log, self._partial = target, log, ""

    def write(self, text: str) -> int:
        self.target.write(text)
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            event = parse_event(line.strip())
            if event is not None:
                self.log.add(event)
        return len(text)

    def flush(self) -> None:
        self.target.flush()


def direct_replay_engine(config: PipelineConfig) -> int:
    from spark_apps.eos_stream.engines.direct_replay import replay

    return replay(config)


class InProcessLauncher:
    """Runs an engine's function (default: the direct replay) in this process, when its events are
    read. The events come once the run has ended (nothing reads a replay's events as they come);
    ``stop`` cannot end a call in this process: a killed task ends with its process.

    :param engine: the engine's entry: a config in, the app's exit code out (or raises).
    """

    def __init__(self, engine: Callable[[PipelineConfig], int] = direct_replay_engine) -> None:
        self.engine = engine
        self.event_log = EventLog()
        self.error: Exception | None = None
        self._config: PipelineConfig | None = None
        self._returncode: int | None = None
        self._duration = 0.0

    def start(self, config: PipelineConfig) -> None:
        self._config = config

    def events(self) -> Iterator[Event]:
        assert self._config is not None, "start() first"
        started = time.monotonic()
        try:
            with contextlib.redirect_stdout(_EventTee(sys.stdout, self.event_log)):
                self._returncode = int(self.engine(self._config))
        except Exception as exc:  # the engine's own failure: the result says it, as an exit would
            self.error = exc
            self._returncode = EXIT_FAILED
            self.event_log.add(("error", {"kind": "failed", "message": f"{type(exc).__name__}: {exc}"}))
        self._duration = round(time.monotonic() - started, 2)
        yield from self.event_log.events

    def stop(self) -> None:
        """Nothing to end apart from this process: the engine runs in the caller's thread."""

    def result(self) -> AppRunResult:
        assert self._returncode is not None, "events() first"
        return AppRunResult(returncode=self._returncode, events=list(self.event_log.events),
                            duration_s=self._duration)
