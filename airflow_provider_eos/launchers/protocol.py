"""The one interface the stream operator and the replay use to run an engine, and what its
implementations share: the config file, the secrets' environment, the process group's end."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import psutil

from airflow_provider_eos.launchers.result import AppRunResult, Event

if TYPE_CHECKING:
    from spark_apps.eos_stream.run.config import PipelineConfig

PASSWORD_ENV = "EOS_PG_PASSWORD"
KAFKA_OPTIONS_ENV = "EOS_KAFKA_OPTIONS_JSON"


class AppLauncher(Protocol):
    """Runs one engine once with one complete config.

    ``start`` begins the run; ``events`` yields the app's ``EOS-`` events as they arrive and ends
    when the run has ended; ``result`` then says how it ended (never raising for the engine's own
    failures); ``stop`` ends a run early (a killed task) and may be called from another thread."""

    def start(self, config: PipelineConfig) -> None: ...

    def events(self) -> Iterator[Event]: ...

    def stop(self) -> None: ...

    def result(self) -> AppRunResult: ...


def run_to_end(launcher: AppLauncher, config: PipelineConfig, on_event: Callable[[str, dict[str, Any]], None]
               | None = None, log: Any = None) -> AppRunResult:
    """Starts ``launcher``, passes each event to ``on_event`` as it arrives (a failing callback is
    logged on ``log``: it must never stop the reading) and returns how the run ended."""
    launcher.start(config)
    for kind, data in launcher.events():
        if on_event is None:
            continue
        try:
            on_event(kind, data)
        except Exception:  # a logging callback must never stop the log reader
            (log or logging.getLogger(__name__)).exception("on_event callback failed for %s", kind)
    return launcher.result()


def secret_env(config: PipelineConfig) -> dict[str, str]:
    """The secrets of ``config`` as the app reads them from its environment
    (``run.config.apply_environment``): they never go into a config file or onto a command line."""
    env: dict[str, str] = {}
    if config.postgres.password:
        env[PASSWORD_ENV] = config.postgres.password
    if config.kafka_options:
        env[KAFKA_OPTIONS_ENV] = json.dumps(config.kafka_options)
    return env


def write_private_config(workdir: str | Path, config: PipelineConfig) -> str:
    """``config``'s JSON (``PipelineConfig.to_json``: no secret) in ``workdir``, readable by its owner only."""
    path = Path(workdir) / "pipeline.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(config.to_json())
    return str(path)


def kill_group(process: subprocess.Popen[Any] | None, log: Any, grace_seconds: float = 5.0) -> None:
    """SIGTERM ``process``'s group (it was started with a session of its own), then SIGKILL
    whatever is left after ``grace_seconds`` -- including descendants that left the group."""
    if process is None or process.poll() is not None:
        return
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    log.info("Stopping process group %s (%d descendants)", process.pid, len(descendants))
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(descendants, timeout=10)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.warning("process %s did not exit after SIGKILL", process.pid)
