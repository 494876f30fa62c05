"""Launch and supervise one eos streaming pipeline by its engine's launcher (``launchers``).

The operator takes the pipeline's validated definition (``PipelineDefinition``; a dict is
validated once), never the pipeline's fields one by one, and a run's ``tuning`` of its stream
section apart (the one templated part): what the pipeline is and its
defaults are defined once (spark_apps/eos_stream/run/config.py, utils/pipeline_definition.py), and
the app's config is ``hooks.app_config.complete_app_config`` of the definition and what a run
sets. Its own arguments are what only a supervisor knows: connections, the run's time, restarts, Spark submission.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_eos.hooks.app_config import complete_app_config
from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.hooks.kafka_connection import kafka_bootstrap_from_connection
from airflow_provider_eos.launchers.choose import launcher_for
from airflow_provider_eos.launchers.protocol import AppLauncher, run_to_end
from airflow_provider_eos.launchers.result import AppRunResult
from airflow_provider_eos.launchers.spark_submit import SparkSubmission
from airflow_provider_eos.links.spark_ui import SparkDriverUILink
from airflow_provider_eos.metrics.scheme import stream_event_metrics
from airflow_provider_eos.metrics.sender import emit
from airflow_provider_eos.operators.stream_errors import failure
from airflow_provider_eos.operators.supervision import (
    Counters,
    End,
    Fail,
    Look,
    Looked,
    Outcome,
    Probe,
    Restart,
    RestartPolicy,
    Step,
    attempt_info,
    next_step,
    run_outcome,
    run_summary,
)
from airflow_provider_eos.recovery.lock import DEFAULT_LOCK_TTL, recovery_hold
from airflow_provider_eos.state.running_lock import running_lock_holder
from airflow_provider_eos.state.stop_requests import set_stop_request, stop_requested_at
from airflow_provider_eos.state.supervisor_lock import acquire_supervisor_lock
from airflow_provider_eos.utils.pipeline_definition import (
    PipelineDefinition,
    PipelineDefinitionError,
    parse_definition,
)
from spark_apps.eos_stream.run.config import PipelineConfig, default_of

# After a fenced exit, how long the driver's own database sessions may take to end (the
# backend sees the closed socket at once; this covers a busy server) before a running
# lock that is still held is taken for another driver's.
OWN_LOCK_RELEASE_SECONDS = 10.0
# How often the supervisor looks again while a recovery holds the pipeline at its start.
RECOVERY_POLL_SECONDS = 5.0
# How often a restart backoff looks for a stop request or a recovery before it ends.
BACKOFF_POLL_SECONDS = 5.0
# The triggers whose run goes on until a stop, a failure or ``run_seconds`` (the continuous engine's: processingTime).
RUNS_UNTIL_STOPPED = ("processingTime",)



class StreamingPipelineOperator(BaseOperator):
    """
    Runs one pipeline by its engine's launcher (``launchers.choose``) and supervises it until it ends.

    Before the first start it takes the pipeline's supervisor lock (a PostgreSQL advisory lock,
    so two tasks never run one pipeline), waits while a recovery holds the pipeline (up to
    ``recovery_wait`` seconds), then clears any stop request. A driver found connected at that
    point has no supervisor (an orphan of a lost worker, or one started by hand): it is logged,
    and the new driver fences it by bumping the pipeline's epoch at its start.

    How an app run ends decides what comes next (:func:`~.supervision.next_step` has the full
    table). Exit 0 ends the task. Exit 2 (configuration error) and exit 4 (a stored offset that
    Kafka no longer holds) fail at once without Airflow retries. Whatever else ended it, a pending stop request
    or a live recovery (see ``recovery_lock_ttl``) ends the task with status ``stopped``, and
    no restart. Exit 3 (fenced: the database took the target from the driver) restarts at once
    from the database's offsets, at most ``max_fenced_restarts`` times, and fails instead when
    another driver now holds the pipeline's running lock. Exit 1 (or death by a signal) is
    retried with exponential backoff up to ``max_restarts`` times; the stop request and the
    recovery are read again during the backoff and at its end, right before the restart (a
    stop request ends the backoff early, and the stop step waits for that). Each end is logged
    with its reason (the last ``EOS-ERROR`` line). The Spark app with ``trigger='availableNow'``
    processes what is in the topics (one incremental batch per DAG run) and succeeds; with
    ``'processingTime'`` it runs until a stop is requested
    (:class:`~airflow_provider_eos.operators.stop.StopPipelineOperator`) or ``run_seconds`` have
    passed, and so does ``engine='continuous'`` (the Spark-less engine, run as a child process in a process
    group of its own in this worker, supervised alike). ``on_kill`` ends the spark-submit's or engine's group.

    :param definition: the pipeline (``PipelineDefinition``, or its dict form, validated once).
        Its ``stream`` section gives the engine, the trigger, the batch limits and the restart policy.
    :param tuning: templated: this run's values for keys of the definition's ``stream`` section
        (``None``: the definition's), e.g. the dict a DAG's ``resolve_run`` task returns.
    :param run_seconds: processingTime and continuous: total time to run, across restarts (0: until stopped).
    :param stop_poll_seconds: how often the app looks for a stop request (default: the app's).
    :param kafka_options: Kafka client options in librdkafka's names, over the Kafka connection's
        own security options (which the app always gets); passed through the environment because
        they may hold secrets, and translated for Spark's Java source by the app.
    :param kafka_config_id: Kafka connection (its extra's ``bootstrap.servers``); default: the
        definition's ``connections.kafka``, else the deployment's ``[eos]`` default.
    :param postgres_conn_id: target database connection; default as for Kafka.
    :param spark_conn_id: Spark connection (master); default as for Kafka.
    :param jars: connector jars (default: ``[eos] spark_jars``, then the definition's ``spark.jars``).
    :param driver_memory: spark-submit ``--driver-memory`` (default: the definition's ``spark.driver_memory``).
    :param spark_conf: more Spark properties, over the definition's ``spark`` section.
    :param driver_host: ``spark.driver.host`` (default 127.0.0.1 for local masters).
    :param driver_bind_address: ``spark.driver.bindAddress`` (default 127.0.0.1 for local masters).
    :param max_restarts: restarts after retryable failures before the task fails (default: the
        definition's ``stream.max_restarts``).
    :param restart_backoff: seconds before the first restart, doubled each time (default: the
        definition's ``stream.restart_backoff``).
    :param max_backoff: upper bound of one backoff.
    :param max_fenced_restarts: immediate restarts after fenced exits (3) before the task fails;
        counted apart from ``max_restarts``, and bounded so two writers cannot fence each other forever.
    :param recovery_lock_ttl: a recovery lock row (``<meta_schema>.recovery_locks``) whose heartbeat
        is older than this belongs to a dead run and holds nothing (the recovery's own ``lock_ttl``).
    :param recovery_wait: seconds to wait at the first start while a recovery holds the pipeline
        (the recovery DAG triggers the stream before its teardown releases the lock) before failing.
    :return: (XCom) a summary dict: status, attempts with their end reasons, batches, rows, offsets.
    """

    template_fields: Sequence[str] = (
        "tuning", "run_seconds", "kafka_config_id", "postgres_conn_id", "spark_conn_id", "max_restarts",
        "restart_backoff", "max_fenced_restarts",
    )
    ui_color = "#e8f4ff"
    operator_extra_links = (SparkDriverUILink(),)

    def __init__(
        self,
        *,
        definition: PipelineDefinition | dict[str, Any],
        tuning: dict[str, Any] | str | None = None,
        run_seconds: float | str = default_of("run_seconds"),
        stop_poll_seconds: float = default_of("stop_poll_seconds"),
        kafka_options: dict[str, str] | None = None,
        kafka_config_id: str | None = None,
        postgres_conn_id: str | None = None,
        spark_conn_id: str | None = None,
        jars: str | None = None,
        driver_memory: str | None = None,
        spark_conf: dict[str, Any] | None = None,
        driver_host: str | None = None,
        driver_bind_address: str | None = None,
        max_restarts: int | str | None = None,
        restart_backoff: float | str | None = None,
        max_backoff: float = 300.0,
        max_fenced_restarts: int | str = 3,
        recovery_lock_ttl: float = DEFAULT_LOCK_TTL,
        recovery_wait: float = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.definition = definition
        self.tuning = tuning
        self.run_seconds = run_seconds
        self.stop_poll_seconds = stop_poll_seconds
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
        self.max_fenced_restarts = max_fenced_restarts
        self.recovery_lock_ttl = recovery_lock_ttl
        self.recovery_wait = recovery_wait
        self._pipeline: PipelineDefinition | None = None
        self._tuned_with: Any = None
        self._orphan: dict[str, Any] | None = None
        self._launcher: AppLauncher | None = None
        self._killed = threading.Event()
        self._lock_conn: Any = None
        # The running driver's UI (the app's EOS-UI line), behind the "Spark driver UI" link.
        self.spark_ui_url: str | None = None
        self._ti: Any = None

    # ------------------------------------------------------------------ config
    @property
    def pipeline(self) -> PipelineDefinition:
        """The definition with this run's ``tuning`` (rendered, so in ``execute``)."""
        if self._pipeline is None or self._tuned_with is not self.tuning:
            self._tuned_with = self.tuning
            try:
                definition = (self.definition if isinstance(self.definition, PipelineDefinition)
                              else parse_definition(self.definition, source=f"task {self.task_id}"))
                self.definition = definition  # a dict is validated once
                if isinstance(self.tuning, str):
                    raise PipelineDefinitionError(f"tuning {self.tuning!r} was not rendered to a dict")
                self._pipeline = definition.tuned(self.tuning)
            except PipelineDefinitionError as exc:
                raise AirflowFailException(str(exc)) from None
        return self._pipeline

    @property
    def meta_schema(self) -> str:
        return self.pipeline.meta_schema

    @property
    def target_schema(self) -> str:
        return self.pipeline.target_schema

    def connection(self, role: str) -> str:
        """The connection id for ``role`` (kafka, postgres, spark): the argument, else the
        definition's, else the deployment's default (read now, not when the DAG was parsed)."""
        given = {"kafka": self.kafka_config_id, "postgres": self.postgres_conn_id, "spark": self.spark_conn_id}[role]
        if given:
            return str(given)
        from airflow_provider_eos.utils import provider_config

        return str(getattr(self.pipeline.connections.resolved(provider_config.connection_defaults()), role))

    def restart_policy(self) -> tuple[int, float]:
        """(max_restarts, restart_backoff): the arguments, else the definition's."""
        stream = self.pipeline.stream
        restarts = stream.max_restarts if self.max_restarts in (None, "") else int(self.max_restarts)
        backoff = stream.restart_backoff if self.restart_backoff in (None, "") else float(self.restart_backoff)
        return restarts, backoff

    def validate(self) -> None:
        restarts, _ = self.restart_policy()
        if restarts < 0 or int(self.max_fenced_restarts) < 0:
            raise AirflowFailException("max_restarts and max_fenced_restarts must be >= 0")

    def pg_hook(self) -> EosPostgresHook:
        return EosPostgresHook(postgres_conn_id=self.connection("postgres"), meta_schema=self.meta_schema)

    def build_config(self, pg: EosPostgresHook | None = None) -> PipelineConfig:
        """The app's complete config (``complete_app_config``): the definition with this run's
        tuning and time, the connections' Kafka and database, secrets included (the launcher
        keeps them off the config file and the command line)."""
        self.validate()
        processing = self.pipeline.stream.trigger in RUNS_UNTIL_STOPPED
        return complete_app_config(
            self.pipeline, kafka_config_id=self.connection("kafka"), postgres=pg or self.pg_hook(),
            kafka_options=self.kafka_options,  # an explicit option of this task wins over the connection's
            run_seconds=float(self.run_seconds) if processing else 0, stop_poll_seconds=float(self.stop_poll_seconds))

    def spark_submission(self) -> SparkSubmission:
        """How the Spark engine is submitted: the definition's spark section; this task's own arguments win."""
        from airflow_provider_eos.utils import provider_config

        spark = self.pipeline.spark
        return SparkSubmission(
            conn_id=self.connection("spark"), jars=self.jars or spark.all_jars(provider_config.spark_jars()),
            conf={**spark.submit_conf(), **(self.spark_conf or {})},
            extra={"driver_host": self.driver_host, "driver_bind_address": self.driver_bind_address,
                   "driver_memory": self.driver_memory or spark.driver_memory, "name": f"eos-{self.pipeline.name}"})

    def launcher(self) -> AppLauncher:
        """What runs the definition's engine: spark-submit for ``spark``, a child process for ``continuous``."""
        engine = self.pipeline.stream.engine
        return launcher_for(engine, self.spark_submission() if engine == "spark" else None)

    # ------------------------------------------------------------------ run
    def backoff(self, restart: int) -> float:
        """Seconds before restart number ``restart`` (1-based)."""
        return self.policy().backoff(restart)

    def execute(self, context: Any) -> dict[str, Any]:
        self._ti = context.get("ti")
        pg = self.pg_hook()
        config = self.build_config(pg)
        pipeline = config.pipeline
        self._lock_conn = acquire_supervisor_lock(pg, pipeline)
        if self._lock_conn is None:
            raise AirflowException(
                f"pipeline {pipeline!r} (meta schema {self.meta_schema!r}) is already supervised by another "
                "task: its supervisor lock is held"
            )
        try:
            self._wait_for_recovery(pg, pipeline)
            set_stop_request(pg, pipeline, False, by=f"airflow:{self.dag_id}.{self.task_id}")
            self._orphan = self._find_orphan(pg, pipeline)
            return self._supervise(pg, config)
        finally:
            self._release_lock()

    def hold_reason(self, pg: EosPostgresHook, pipeline: str) -> str | None:
        """Why the pipeline must not be (re)started now: its stop request, or a recovery that
        holds its target (the recovery keeps the stop request set too; the lock row also
        covers a stop request cleared by hand). None: it may start."""
        stop_at = stop_requested_at(pg, pipeline)
        if stop_at is not None:
            return f"a stop was requested at {stop_at}"
        hold = recovery_hold(pg, pipeline, self.target_schema, float(self.recovery_lock_ttl))
        if hold is not None:
            return (f"recovery {hold['holder']} holds the pipeline's target (since {hold['acquired_at']}, "
                    f"heartbeat {hold['heartbeat_age_seconds']:.0f}s ago)")
        return None

    def _wait_for_recovery(self, pg: EosPostgresHook, pipeline: str) -> None:
        """Never clear a recovery's stop request or fence its replay: wait for it to end. The
        recovery DAG itself triggers the stream before its teardown releases the lock."""
        deadline = time.monotonic() + float(self.recovery_wait)
        while (hold := recovery_hold(pg, pipeline, self.target_schema, float(self.recovery_lock_ttl))) is not None:
            if time.monotonic() >= deadline:
                raise AirflowException(
                    f"pipeline {pipeline!r}: recovery {hold['holder']} still holds its target after "
                    f"{float(self.recovery_wait):g}s (since {hold['acquired_at']}); not starting under it"
                )
            self.log.info("Pipeline %r: recovery %s holds its target (heartbeat %.0fs ago); waiting for it to end",
                          pipeline, hold["holder"], hold["heartbeat_age_seconds"])
            if self._killed.wait(RECOVERY_POLL_SECONDS):
                raise AirflowException(f"pipeline {pipeline!r} was killed while waiting for a recovery to end")

    def _find_orphan(self, pg: EosPostgresHook, pipeline: str) -> dict[str, Any] | None:
        """A driver connected while this task holds the supervisor lock has no supervisor."""
        holder = running_lock_holder(pg, pipeline)
        if holder is not None:
            self.log.warning(
                "Pipeline %r: a driver without a supervisor holds the running lock (database backend pid %s, "
                "application %r, client %s:%s, connected since %s): an orphan of a lost worker, or a driver "
                "started by hand. The new driver fences it (it bumps the pipeline's epoch at start); the orphan "
                "commits nothing more, exits 3 within stop_poll_seconds (or at its in-flight batch) and frees "
                "the running lock, which the new driver waits up to 60s for.",
                pipeline, holder["pid"], holder["application_name"], holder["client_addr"], holder["client_port"],
                holder["backend_start"])
        return holder

    def _on_event(self, pipeline: str, kind: str, data: dict[str, Any]) -> None:
        if kind == "ui" and data.get("url"):
            self._show_spark_ui(pipeline, str(data["url"]))
        # Each batch's rows per second, rows applied and new dead letters, as they happen.
        emit(stream_event_metrics(pipeline, kind, data))
        # "resume" comes after the new driver bumped the epoch and got the running lock:
        # the orphan can no longer write, and it has gone.
        if kind == "resume" and self._orphan is not None and "fenced_at_epoch" not in self._orphan:
            self.log.warning("Pipeline %r: the orphan driver (database backend pid %s) was fenced and has exited; "
                             "the new driver holds the running lock at epoch %s", pipeline, self._orphan["pid"],
                             data.get("epoch"))
            self._orphan = {**self._orphan, "fenced_at_epoch": data.get("epoch")}

    def _show_spark_ui(self, pipeline: str, url: str) -> None:
        """Points the task's "Spark driver UI" link at a new driver while it runs: the API
        server reads the link from this XCom (Airflow itself only writes it when the task ends)."""
        self.spark_ui_url = url
        self.log.info("Pipeline %r: Spark driver UI at %s", pipeline, url)
        if self._ti is not None:
            try:
                self._ti.xcom_push(key=SparkDriverUILink().xcom_key, value=url)
            except Exception:  # a link is not worth failing a stream for
                self.log.warning("Could not store the Spark UI link", exc_info=True)

    def _backoff_unless_held(self, pg: EosPostgresHook, pipeline: str, delay: float) -> str | None:
        """Sleeps ``delay`` seconds, then returns :meth:`hold_reason`. Also looks every
        ``BACKOFF_POLL_SECONDS`` meanwhile, so a stop ends a long backoff early (a
        StopPipelineOperator waits for this task to release its supervisor lock)."""
        deadline = time.monotonic() + delay
        while (remaining := deadline - time.monotonic()) > 0:
            if self._killed.wait(min(remaining, BACKOFF_POLL_SECONDS)):
                raise AirflowException(f"pipeline {pipeline!r} was killed while waiting to restart")
            if remaining > BACKOFF_POLL_SECONDS and (held := self.hold_reason(pg, pipeline)) is not None:
                return held
        return self.hold_reason(pg, pipeline)

    def _other_driver(self, pg: EosPostgresHook, pipeline: str) -> dict[str, Any] | None:
        """The driver holding the running lock once this task's own (exited) driver's sessions are gone."""
        deadline = time.monotonic() + OWN_LOCK_RELEASE_SECONDS
        while (holder := running_lock_holder(pg, pipeline)) is not None and time.monotonic() < deadline:
            if self._killed.wait(0.5):
                raise AirflowException(f"pipeline {pipeline!r} was killed while checking its running lock")
        return holder

    def _release_lock(self) -> None:
        conn, self._lock_conn = self._lock_conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # closing a dead connection
                pass

    def _supervise(self, pg: EosPostgresHook, config: PipelineConfig) -> dict[str, Any]:
        """Runs the app until :func:`~.supervision.next_step` ends or fails the task, performing
        each step it decides."""
        pipeline = config.pipeline
        deadline = (time.monotonic() + float(config.run_seconds)
                    if config.trigger in RUNS_UNTIL_STOPPED and float(config.run_seconds) > 0 else None)
        attempts: list[dict[str, Any]] = []
        results: list[AppRunResult] = []
        counters, policy = Counters(), self.policy()
        while True:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    status = "run_seconds elapsed"
                    break
                config = replace(config, run_seconds=round(remaining, 1))  # a restart gets what is left
            result, info = self._run_once(pg, config, len(attempts) + 1)
            results.append(result)
            attempts.append(info)
            reason = info["reason"]
            step = self._decide(pg, pipeline, run_outcome(result, self._killed.is_set()), counters, policy)
            if isinstance(step, Fail):
                raise failure(step, pipeline, attempts, counters, policy,
                              {role: self.connection(role) for role in ("kafka", "postgres")})
            if isinstance(step, End):
                if step.held is not None:
                    self.log.warning("Pipeline %r ended (%s) while %s: not restarting", pipeline, reason, step.held)
                status = step.status
                break
            assert isinstance(step, Restart)
            held = self._restart_wait(pg, pipeline, step, policy, reason)
            if held is not None:
                status = "stopped"
                break
            counters = step.counters
        summary = {**run_summary(config, status, attempts, results, counters), "orphan": self._orphan}
        self.log.info("Pipeline %r %s: %s", pipeline, status, summary)
        return summary

    def policy(self) -> RestartPolicy:
        restarts, backoff = self.restart_policy()
        return RestartPolicy(max_restarts=restarts, max_fenced_restarts=int(self.max_fenced_restarts),
                             restart_backoff=backoff, max_backoff=float(self.max_backoff))

    def _run_once(self, pg: EosPostgresHook, config: PipelineConfig,
                  attempt: int) -> tuple[AppRunResult, dict[str, Any]]:
        """One run of the app by its engine's launcher, its events sent on as they come; with its summary line."""
        pipeline = config.pipeline
        self.log.info("Starting pipeline %r, attempt %d (engine %s, trigger %s, delivery %s)",
                      pipeline, attempt, config.engine, config.trigger, config.delivery)
        self._launcher = launcher = self.launcher()
        try:
            result = run_to_end(launcher, config, lambda kind, data: self._on_event(pipeline, kind, data), self.log)
        except BaseException:
            launcher.stop()  # nothing of a run that failed to start or to be read may outlive it
            raise
        info = attempt_info(attempt, result)
        self.log.info("Pipeline %r attempt %d ended after %.1fs: %s (batches %d, rows applied %d)",
                      pipeline, attempt, result.duration_s, info["reason"], info["batches"], info["rows_applied"])
        return result, info

    def _decide(self, pg: EosPostgresHook, pipeline: str, outcome: Outcome, counters: Counters,
                policy: RestartPolicy) -> Step:
        """:func:`~.supervision.next_step`, with what it asks to be looked up."""
        looked = Looked()
        while isinstance(step := next_step(outcome, counters, policy, looked), Look):
            answer = self.hold_reason(pg, pipeline) if step.probe is Probe.HOLD else self._other_driver(pg, pipeline)
            looked = looked.having(step.probe, answer)
        return step

    def _restart_wait(self, pg: EosPostgresHook, pipeline: str, step: Restart, policy: RestartPolicy,
                      reason: str) -> str | None:
        """Waits before a restart: not at all after a fence, else the backoff, during which a stop
        or a recovery cancels the restart (returned: why it holds)."""
        if step.delay <= 0:
            # No backoff: nothing is broken, the new driver resumes from the stored offsets.
            self.log.warning("Pipeline %r was fenced: restarting at once from the database's offsets "
                             "(fenced restart %d of %d). %s", pipeline, step.counters.fenced_restarts,
                             policy.max_fenced_restarts, reason)
            return None
        self.log.warning("Restarting pipeline %r in %.1fs (restart %d of %d) because: %s",
                         pipeline, step.delay, step.counters.restarts, policy.max_restarts, reason)
        # A recovery may stop the stream and begin its restore during the backoff: its stop
        # step passes while no driver is connected. Read again right before restarting.
        held = self._backoff_unless_held(pg, pipeline, step.delay)
        if held is not None:
            self.log.warning("Pipeline %r: not restarting (read during the backoff, before the restart): %s",
                             pipeline, held)
        return held

    def get_openlineage_facets_on_start(self) -> Any:
        """The topics it reads and the target tables it writes (OpenLineage: topic -> pipeline -> tables)."""
        from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
        from airflow_provider_eos.utils.lineage import operator_lineage, topics_read
        from airflow_provider_eos.utils.subscription import subscribed_topics
        from spark_apps.eos_stream.records.spec import spec_of

        kafka = self.connection("kafka")
        topics = topics_read(subscribed_topics(self.pipeline), KafkaOffsetsHook(kafka_config_id=kafka).resolve_topics)
        return operator_lineage(kafka_bootstrap_from_connection(kafka), topics,
                                EosPostgresHook(postgres_conn_id=self.connection("postgres")).app_target(),
                                self.target_schema, spec_of(self.pipeline))

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        return self.get_openlineage_facets_on_start()

    def on_kill(self) -> None:
        self._killed.set()
        launcher = self._launcher
        if launcher is not None:
            launcher.stop()
        self._release_lock()
