"""Launch and supervise one eos streaming pipeline (spark-submit of spark_apps/eos_stream/app.py)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.hooks.stream_submit import EXIT_OK, AppRunResult, EosStreamSubmitHook
from spark_apps.eos_stream.config import DELIVERY_MODES

TRIGGERS = ("availableNow", "processingTime")
# PipelineConfig keys the operator sets from its own arguments or the connections.
_OWN_KEYS = frozenset(
    {"pipeline", "topics", "kafka_bootstrap", "spec", "delivery", "trigger", "trigger_interval",
     "max_offsets_per_trigger", "checkpoint_dir", "target_schema", "meta_schema", "max_batch_attempts",
     "create_targets", "run_seconds", "stop_poll_seconds", "postgres"}
)


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class PipelineConfigError(AirflowFailException):
    """The pipeline configuration is wrong: the app exited 2; retrying will not help."""


def kafka_bootstrap_from_connection(kafka_config_id: str) -> str:
    """``bootstrap.servers`` from the extra of a ``kafka`` connection."""
    conn = KafkaBaseHook.get_connection(kafka_config_id)
    bootstrap = (conn.extra_dejson or {}).get("bootstrap.servers")
    if not bootstrap:
        raise AirflowFailException(f"connection {kafka_config_id!r} has no 'bootstrap.servers' in its extra")
    return str(bootstrap)


class StreamingPipelineOperator(BaseOperator):
    """
    Runs one pipeline with spark-submit and supervises it until it ends.

    Before the first start it clears any stop request of the pipeline and takes the pipeline's
    supervisor lock (a PostgreSQL advisory lock, so two tasks never run one pipeline). An app
    exit 1 (or death by a signal) is retried with exponential backoff up to ``max_restarts``
    times, each end logged with its reason (the last ``EOS-ERROR`` line); exit 2 (configuration
    error) fails at once without Airflow retries. ``trigger='availableNow'`` processes what is in
    the topics (one incremental batch per DAG run) and succeeds; ``'processingTime'`` runs until a
    stop is requested (:class:`~airflow_provider_eos.operators.stop.StopPipelineOperator`) or
    ``run_seconds`` have passed. ``on_kill`` ends the spark-submit process group (no JVM is left).

    :param pipeline: pipeline name (keys offsets, progress, dead letters, stop requests).
    :param topics: Kafka topics to read.
    :param spec: ``module:ATTRIBUTE`` of the app's PipelineSpec.
    :param delivery: ``exactly_once`` (default), ``two_phase`` (the same with PREPARE TRANSACTION /
        COMMIT PREPARED; needs ``max_prepared_transactions`` > 0), ``idempotent`` or ``at_least_once``.
    :param trigger: ``availableNow`` (default) or ``processingTime``.
    :param trigger_interval: processingTime interval, e.g. "5 seconds".
    :param max_offsets_per_trigger: bound on records per micro-batch.
    :param checkpoint_dir: Spark checkpoint root (default: the app's).
    :param target_schema: schema of the target tables.
    :param meta_schema: schema of the bookkeeping tables.
    :param max_batch_attempts: failed attempts of one batch before its poison records are quarantined.
    :param create_targets: let the app create missing target tables.
    :param run_seconds: processingTime: total time to run, across restarts (0: until stopped).
    :param stop_poll_seconds: how often the app looks for a stop request.
    :param extra_config: more PipelineConfig keys (never a password).
    :param kafka_options: extra Kafka client options (Java client names, without ``kafka.``), passed
        through the environment because they may hold secrets.
    :param kafka_config_id: Kafka connection (its extra's ``bootstrap.servers``), default "kafka_default".
    :param postgres_conn_id: target database connection, default "eos_postgres".
    :param spark_conn_id: Spark connection (master), default "spark_default".
    :param jars: connector jars (default: env ``EOS_SPARK_JARS``).
    :param driver_memory: spark-submit ``--driver-memory``.
    :param spark_conf: more Spark properties.
    :param driver_host: ``spark.driver.host`` (default 127.0.0.1 for local masters).
    :param driver_bind_address: ``spark.driver.bindAddress`` (default 127.0.0.1 for local masters).
    :param max_restarts: restarts after retryable failures before the task fails.
    :param restart_backoff: seconds before the first restart; doubled each time.
    :param max_backoff: upper bound of one backoff.
    :return: (XCom) a summary dict: status, attempts with their end reasons, batches, rows, offsets.
    """

    template_fields: Sequence[str] = (
        "pipeline", "topics", "spec", "delivery", "trigger", "trigger_interval", "max_offsets_per_trigger",
        "checkpoint_dir", "target_schema", "meta_schema", "max_batch_attempts", "create_targets",
        "run_seconds", "extra_config", "kafka_config_id", "postgres_conn_id", "spark_conn_id", "max_restarts",
        "restart_backoff",
    )
    ui_color = "#e8f4ff"

    def __init__(
        self,
        *,
        pipeline: str,
        topics: Sequence[str] | str,
        spec: str = "spark_apps.ledger.spec:LEDGER",
        delivery: str = "exactly_once",
        trigger: str = "availableNow",
        trigger_interval: str = "5 seconds",
        max_offsets_per_trigger: int | str = 20000,
        checkpoint_dir: str | None = None,
        target_schema: str = "public",
        meta_schema: str = "eos",
        max_batch_attempts: int | str = 3,
        create_targets: bool | str = False,
        run_seconds: float | str = 0,
        stop_poll_seconds: float = 1.0,
        extra_config: dict[str, Any] | None = None,
        kafka_options: dict[str, str] | None = None,
        kafka_config_id: str = "kafka_default",
        postgres_conn_id: str = "eos_postgres",
        spark_conn_id: str = "spark_default",
        jars: str | None = None,
        driver_memory: str | None = "1g",
        spark_conf: dict[str, Any] | None = None,
        driver_host: str | None = None,
        driver_bind_address: str | None = None,
        max_restarts: int | str = 3,
        restart_backoff: float | str = 10.0,
        max_backoff: float = 300.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.topics = topics
        self.spec = spec
        self.delivery = delivery
        self.trigger = trigger
        self.trigger_interval = trigger_interval
        self.max_offsets_per_trigger = max_offsets_per_trigger
        self.checkpoint_dir = checkpoint_dir
        self.target_schema = target_schema
        self.meta_schema = meta_schema
        self.max_batch_attempts = max_batch_attempts
        self.create_targets = create_targets
        self.run_seconds = run_seconds
        self.stop_poll_seconds = stop_poll_seconds
        self.extra_config = extra_config or {}
        self.kafka_options = kafka_options
        self.kafka_config_id = kafka_config_id
        self.postgres_conn_id = postgres_conn_id
        self.spark_conn_id = spark_conn_id
        self.jars = jars
        self.driver_memory = driver_memory
        self.spark_conf = spark_conf
        self.driver_host = driver_host
        self.driver_bind_address = driver_bind_address
        self.max_restarts = max_restarts
        self.restart_backoff = restart_backoff
        self.max_backoff = max_backoff
        self._hook: EosStreamSubmitHook | None = None
        self._killed = threading.Event()
        self._lock_conn: Any = None

    # ------------------------------------------------------------------ config
    def _topics(self) -> list[str]:
        topics = self.topics
        if isinstance(topics, str):
            topics = [t.strip() for t in topics.split(",") if t.strip()]
        return [str(t) for t in topics]

    def validate(self) -> None:
        if self.trigger not in TRIGGERS:
            raise AirflowFailException(f"trigger must be one of {TRIGGERS}, got {self.trigger!r}")
        if self.delivery not in DELIVERY_MODES:
            raise AirflowFailException(f"delivery must be one of {DELIVERY_MODES}, got {self.delivery!r}")
        if not self.pipeline or not self._topics():
            raise AirflowFailException("a pipeline name and at least one topic are required")
        clash = _OWN_KEYS & set(self.extra_config)
        if clash:
            raise AirflowFailException(f"extra_config must not set {sorted(clash)}: use the operator's arguments")
        if int(self.max_restarts) < 0:
            raise AirflowFailException("max_restarts must be >= 0")

    def pg_hook(self) -> EosPostgresHook:
        return EosPostgresHook(postgres_conn_id=self.postgres_conn_id, meta_schema=self.meta_schema)

    def build_config(self, pg: EosPostgresHook | None = None) -> dict[str, Any]:
        """The app's config (PipelineConfig keys) from the arguments and the connections; no secret."""
        self.validate()
        pg = pg or self.pg_hook()
        config: dict[str, Any] = {
            "pipeline": self.pipeline,
            "topics": self._topics(),
            "kafka_bootstrap": kafka_bootstrap_from_connection(self.kafka_config_id),
            "spec": self.spec,
            "delivery": self.delivery,
            "trigger": self.trigger,
            "trigger_interval": self.trigger_interval,
            "max_offsets_per_trigger": int(self.max_offsets_per_trigger),
            "target_schema": self.target_schema,
            "meta_schema": self.meta_schema,
            "max_batch_attempts": int(self.max_batch_attempts),
            "create_targets": _as_bool(self.create_targets),
            "run_seconds": float(self.run_seconds) if self.trigger == "processingTime" else 0,
            "stop_poll_seconds": float(self.stop_poll_seconds),
            "postgres": pg.app_target(),
        }
        if self.checkpoint_dir:
            config["checkpoint_dir"] = self.checkpoint_dir
        config.update(self.extra_config)
        return config

    def submit_hook(self, pg: EosPostgresHook) -> EosStreamSubmitHook:
        return EosStreamSubmitHook(
            conn_id=self.spark_conn_id,
            jars=self.jars,
            postgres_password=pg.app_password(),
            kafka_options=self.kafka_options,
            driver_host=self.driver_host,
            driver_bind_address=self.driver_bind_address,
            conf=self.spark_conf,
            driver_memory=self.driver_memory,
            name=f"eos-{self.pipeline}",
        )

    # ------------------------------------------------------------------ run
    def backoff(self, restart: int) -> float:
        """Seconds before restart number ``restart`` (1-based)."""
        return min(float(self.max_backoff), float(self.restart_backoff) * 2 ** (restart - 1))

    def execute(self, context: Any) -> dict[str, Any]:
        pg = self.pg_hook()
        config = self.build_config(pg)
        pipeline = config["pipeline"]
        self._lock_conn = pg.acquire_supervisor_lock(pipeline)
        if self._lock_conn is None:
            raise AirflowException(
                f"pipeline {pipeline!r} (meta schema {self.meta_schema!r}) is already supervised by another "
                "task: its supervisor lock is held"
            )
        try:
            pg.clear_stop(pipeline)
            return self._supervise(pg, config)
        finally:
            self._release_lock()

    def _release_lock(self) -> None:
        conn, self._lock_conn = self._lock_conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # closing a dead connection
                pass

    def _supervise(self, pg: EosPostgresHook, config: dict[str, Any]) -> dict[str, Any]:
        pipeline = config["pipeline"]
        deadline = (time.monotonic() + float(config["run_seconds"])
                    if config["trigger"] == "processingTime" and float(config["run_seconds"]) > 0 else None)
        attempts: list[dict[str, Any]] = []
        results: list[AppRunResult] = []
        restarts = 0
        status = "failed"
        while True:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    status = "run_seconds elapsed"
                    break
                config["run_seconds"] = round(remaining, 1)
            attempt = len(attempts) + 1
            self.log.info("Starting pipeline %r, attempt %d (trigger %s, delivery %s)",
                          pipeline, attempt, config["trigger"], config["delivery"])
            hook = self.submit_hook(pg)
            self._hook = hook
            try:
                result = hook.run_app(config)
            finally:
                hook.cleanup()
            results.append(result)
            info = self._attempt_info(attempt, result)
            attempts.append(info)
            self.log.info("Pipeline %r attempt %d ended after %.1fs: %s (batches %d, rows applied %d)",
                          pipeline, attempt, result.duration_s, info["reason"], info["batches"], info["rows_applied"])
            if self._killed.is_set():
                raise AirflowException(f"pipeline {pipeline!r} was killed: {info['reason']}")
            if result.returncode == EXIT_OK:
                status = "stopped" if result.of("stopped") else "finished"
                break
            if result.config_error:
                raise PipelineConfigError(
                    f"pipeline {pipeline!r}: configuration error, not restarted: {info['reason']}"
                )
            stop_at = pg.stop_requested_at(pipeline)
            if stop_at is not None:
                self.log.warning("Pipeline %r failed (%s) while a stop was requested at %s: not restarting",
                                 pipeline, info["reason"], stop_at)
                status = "stopped"
                break
            if restarts >= int(self.max_restarts):
                raise AirflowException(self._exhausted_message(pipeline, attempts))
            restarts += 1
            delay = self.backoff(restarts)
            self.log.warning("Restarting pipeline %r in %.1fs (restart %d of %d) because: %s",
                             pipeline, delay, restarts, int(self.max_restarts), info["reason"])
            if self._killed.wait(delay):
                raise AirflowException(f"pipeline {pipeline!r} was killed while waiting to restart")
        summary = self._summary(config, status, attempts, results, restarts)
        self.log.info("Pipeline %r %s: %s", pipeline, status, summary)
        return summary

    @staticmethod
    def _attempt_info(attempt: int, result: AppRunResult) -> dict[str, Any]:
        batches = result.of("batch")
        starts = result.of("start")
        return {
            "attempt": attempt,
            "returncode": result.returncode,
            "reason": result.reason(),
            "duration_s": result.duration_s,
            "run_id": starts[-1].get("run_id") if starts else None,
            "batches": len(batches),
            "rows_applied": sum(int(b.get("applied") or 0) for b in batches),
            "dead_lettered": sum(int(b.get("dead_lettered") or 0) for b in batches),
        }

    @staticmethod
    def _exhausted_message(pipeline: str, attempts: list[dict[str, Any]]) -> str:
        lines = [f"pipeline {pipeline!r} failed {len(attempts)} times; restarts exhausted "
                 f"({len(attempts) - 1} restarts). How each attempt ended:"]
        lines += [f"  attempt {a['attempt']} ({a['duration_s']:.0f}s, {a['batches']} batches): {a['reason']}"
                  for a in attempts]
        return "\n".join(lines)

    @staticmethod
    def _summary(config: dict[str, Any], status: str, attempts: list[dict[str, Any]],
                 results: list[AppRunResult], restarts: int) -> dict[str, Any]:
        end_offsets = None
        for result in reversed(results):
            batches = result.of("batch")
            if batches:
                end_offsets = batches[-1].get("end_offsets")
                if isinstance(end_offsets, str):
                    end_offsets = json.loads(end_offsets)
                break
        return {
            "pipeline": config["pipeline"],
            "trigger": config["trigger"],
            "delivery": config["delivery"],
            "status": status,
            "restarts": restarts,
            "attempts": attempts,
            "batches": sum(a["batches"] for a in attempts),
            "rows_applied": sum(a["rows_applied"] for a in attempts),
            "dead_lettered": sum(a["dead_lettered"] for a in attempts),
            "end_offsets": end_offsets,
        }

    def on_kill(self) -> None:
        self._killed.set()
        hook = self._hook
        if hook is not None:
            hook.on_kill()
        self._release_lock()
