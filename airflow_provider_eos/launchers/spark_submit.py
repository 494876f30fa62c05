"""The Spark app under spark-submit, through the Spark provider's hook
(``hooks.stream_submit.EosStreamSubmitHook``): the one launcher that goes through a Spark hook."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_provider_eos.launchers.result import AppRunResult, Event

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.stream_submit import EosStreamSubmitHook
    from spark_apps.eos_stream.run.config import PipelineConfig

# How often the reader of the events wakes while the submit runs: a kill's signal handler runs then.
_POLL_SECONDS = 0.5
_DONE = object()


@dataclass
class SparkSubmission:
    """How to spark-submit: :class:`~airflow_provider_eos.hooks.stream_submit.EosStreamSubmitHook`'s
    arguments other than the secrets, which come from the config at ``start``.

    :param conn_id: the Spark connection (master).
    :param jars: connector jars (None: ``[eos] spark_jars``).
    :param conf: Spark properties.
    :param extra: further hook arguments (driver_memory, name, driver_host, driver_bind_address...).
    """

    conn_id: str = "spark_default"
    jars: str | None = None
    conf: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def hook(self, config: PipelineConfig) -> EosStreamSubmitHook:
        """The hook for one run of ``config``: its secrets go to the hook's environment handling."""
        from airflow_provider_eos.hooks.stream_submit import EosStreamSubmitHook

        return EosStreamSubmitHook(conn_id=self.conn_id, jars=self.jars, conf=dict(self.conf),
                                   postgres_password=config.postgres.password,
                                   kafka_options=dict(config.kafka_options) or None, **self.extra)


class SparkSubmitLauncher:
    """spark-submits the app once; the hook reads the driver's log in a thread of its own, so that
    ``events`` yields each event as the driver writes it."""

    def __init__(self, submission: SparkSubmission) -> None:
        self.submission = submission
        self.hook: EosStreamSubmitHook | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._outcome: AppRunResult | BaseException | None = None

    def start(self, config: PipelineConfig) -> None:
        self.hook = hook = self.submission.hook(config)
        hook.on_event = lambda kind, data: self._queue.put((kind, data))
        app_config = json.loads(config.to_json())

        def submit() -> None:
            try:
                self._outcome = hook.run_app(app_config)
            except BaseException as exc:  # raised again where the events are read
                self._outcome = exc
            finally:
                self._queue.put(_DONE)

        self._thread = threading.Thread(target=submit, name=f"spark-submit-{config.pipeline}", daemon=True)
        self._thread.start()

    def events(self) -> Iterator[Event]:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
            if item is _DONE:
                break
            yield item
        if self._thread is not None:
            self._thread.join()
        if isinstance(self._outcome, BaseException):
            raise self._outcome

    def stop(self) -> None:
        if self.hook is not None:
            self.hook.on_kill()

    def result(self) -> AppRunResult:
        if self._thread is not None:
            self._thread.join()
        if self.hook is not None:
            self.hook.cleanup()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert isinstance(self._outcome, AppRunResult), "start() and events() first"
        return self._outcome
