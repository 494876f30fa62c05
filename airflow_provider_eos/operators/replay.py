"""Replay after a restore: the retention check, the availableNow replay run and
the caught-up check."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException
from psycopg2 import sql

from airflow_provider_eos.operators.base import KafkaOffsetsMixin, timed_step
from airflow_provider_eos.recovery.catalog import stored_offsets_in
from airflow_provider_eos.recovery.contracts import ChosenSnapshot, Replayed
from airflow_provider_eos.recovery.lock import DEFAULT_LOCK_TTL
from airflow_provider_eos.recovery.manifest import LATEST, SnapshotError
from airflow_provider_eos.state.activity import stream_activity
from airflow_provider_eos.utils.params import as_bool
from airflow_provider_eos.utils.replay_engine import (
    DEFAULT_DIRECT_MAX_RECORDS,
    DEFAULT_REPLAY_ENGINE,
    REPLAY_ENGINE_CHOICES,
    choose_replay_engine,
)
from airflow_provider_eos.utils.subscription import subscribed_topics
from spark_apps.eos_stream.kafka.offsets import from_nested, to_nested

if TYPE_CHECKING:
    from airflow_provider_eos.launchers.protocol import AppLauncher
    from spark_apps.eos_stream.run.config import PipelineConfig

DEFAULT_SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
}


class PipelineNotStoppedError(AirflowException):
    """No stop request holds the pipeline: a supervisor may start a driver that fights the replay."""


class RetentionCheckOperator(KafkaOffsetsMixin, BaseOperator):
    """
    Checks that Kafka still holds every record from a replay point on: for every
    partition ``earliest <= needed <= log end``. Fails naming each partition and
    the size of its gap, BEFORE anything is restored. A compacted topic is refused
    (``CompactedTopicError``); offsets of topics no longer in the definition are not
    needed (reported as ``retired_topics``; see docs/recovery.md).

    The replay point is the chosen snapshot's offsets (``snapshot`` given) or the
    offsets stored in the database (``snapshot=None``).

    :param definition: the pipeline (``PipelineDefinition``, its dict, or its name); its complete app config
        comes from one call (``PipelineOperatorMixin.app_config``).
    :param pipeline_config: deprecated (read for one release): the app's config, dict or JSON file path.
    :param snapshot: ``latest``, an id, an ISO-8601 timestamp, or None for the database (templated); or
        the snapshot an earlier step chose (``contracts.ChosenSnapshot``'s XCom, e.g. the choosing
        task's ``.output``), whose offsets are checked without choosing again.
    :param snapshot_store: local directory or object storage URL (templated); default: the
        deployment's ``[eos] snapshot_store`` (see :mod:`airflow_provider_eos.utils.provider_config`),
        read at execute time.
    :param kafka_config_id: The connection object to use, defaults to "kafka_default"
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    """

    template_fields: Sequence[str] = ("pipeline_config", "snapshot", "snapshot_store")

    def __init__(self, *, definition: Any = None, pipeline_config: Any = None,
                 snapshot: Any = LATEST, snapshot_store: Any = None,
                 kafka_config_id: str = "kafka_default", postgres_conn_id: str = "eos_postgres",
                 pg_bin_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.take_definition(definition, pipeline_config)
        self.snapshot = snapshot
        self.snapshot_store = snapshot_store
        self.kafka_config_id = kafka_config_id
        self.postgres_conn_id = postgres_conn_id
        self.pg_bin_dir = pg_bin_dir

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        if isinstance(self.snapshot, Mapping):
            chosen = ChosenSnapshot.from_xcom(self.snapshot)
            needed, what = chosen.replay_point, f"snapshot {chosen.snapshot_id}"
        elif self.snapshot:
            try:
                manifest = self.resolve_store().select(config.pipeline, str(self.snapshot))
            except SnapshotError as exc:
                raise AirflowException(f"pipeline {config.pipeline!r}: {exc}") from exc
            needed, what = manifest.offsets(), f"snapshot {manifest.snapshot_id}"
        else:
            conn = self.hook.connect()
            try:
                needed = stored_offsets_in(conn, config.meta_schema, config.pipeline)
            finally:
                conn.close()
            what = "from the database's stored offsets"
        report = self.check_retention(needed, subscribed_topics(config), what)
        self.log.info("retention check passed for %s: %d records to replay", what, report["records_to_replay"])
        return report


class ReplayOperator(KafkaOffsetsMixin, BaseOperator):
    """
    Replays Kafka into the (restored) database from the offsets stored in it.

    Reads the stored offsets, checks Kafka still retains them (fails before
    starting anything otherwise), chooses the engine (``engine``; ``auto`` by the
    records to replay, see :mod:`airflow_provider_eos.utils.replay_engine`),
    then replays through that engine's launcher (``launchers.choose``): ``direct`` in this
    process, or ``spark``, the streaming app run once with ``trigger=availableNow`` under
    spark-submit (``launchers.spark_submit``; ``spark_apps`` shipped for non-local masters; the database password and
    the Kafka client options only in the environment or a private properties
    file, never on the command line). In ``exactly_once`` delivery every run
    starts a fresh checkpoint from the database's offsets, so the replay begins
    exactly at the restored point. Succeeds when the stored offsets reached the
    last stable offsets seen at its start on every partition.

    The pipeline's stop request stays set for the whole replay: the replay run
    alone gets ``ignore_stop_request``, so no supervisor can restart the stream
    under the recovery, and the replay driver's own start bumps the pipeline's
    epoch, fencing any driver that still holds an older one. The replay reads
    Kafka through ``kafka_config_id`` (its ``bootstrap.servers``), the cluster
    the retention check and the caught-up check look at.

    :param definition: the pipeline (``PipelineDefinition``, its dict, or its name); its complete app config
        comes from one call (``PipelineOperatorMixin.app_config``).
    :param pipeline_config: deprecated (read for one release): the app's config, dict or JSON file path.
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param kafka_config_id: The connection object to use, defaults to "kafka_default"
    :param spark_conn_id: The connection object to use, defaults to "spark_default"
    :param jars: comma-separated jars for spark-submit (default: ``[eos] spark_jars``).
    :param spark_conf: extra Spark conf.
    :param driver_memory: spark-submit driver memory.
    :param checkpoint_dir: override the config's checkpoint root.
    :param kafka_options: Kafka client options (librdkafka names, over the connection's own), merged
        over the config's; passed through the environment because they may hold secrets.
    :param require_stop_request: refuse to replay unless a stop request holds the pipeline (default True).
    :param hold_lock: hold the target's recovery lock while working (a recovery step).
    :param lock_ttl: seconds without heartbeat after which a lock left behind is taken over.
    :param plan_only: report the plan (offsets, retention) without running.
    :param engine: ``auto`` (the default: ``direct`` when the records between the stored offsets
        and the last stable offsets are at most ``direct_max_records``, ``spark`` otherwise),
        ``spark`` (the app through spark-submit, on the Spark connection's master) or ``direct``
        (``spark_apps.eos_stream.engines.direct_replay`` in this worker: the same claim and sink without
        Spark, so no cold spark-submit and no cold first batch; one process reads). The choice is
        logged and returned as ``engine`` (:class:`~airflow_provider_eos.utils.replay_engine.ReplayChoice`).
    :param direct_max_records: ``auto``'s threshold (a definition's ``stream.replay_direct_max_records``).
    """

    template_fields: Sequence[str] = ("pipeline_config", "jars", "checkpoint_dir", "plan_only")
    ui_color = "#e7eefc"

    def __init__(self, *, definition: Any = None, pipeline_config: Any = None,
                 postgres_conn_id: str = "eos_postgres",
                 kafka_config_id: str = "kafka_default", spark_conn_id: str = "spark_default",
                 jars: str | None = None, spark_conf: dict[str, str] | None = None, driver_memory: str = "1g",
                 checkpoint_dir: str | None = None, kafka_options: dict[str, str] | None = None,
                 require_stop_request: bool = True, hold_lock: bool = False, lock_ttl: float = DEFAULT_LOCK_TTL,
                 plan_only: Any = False, pg_bin_dir: str | None = None, engine: str = DEFAULT_REPLAY_ENGINE,
                 direct_max_records: int = DEFAULT_DIRECT_MAX_RECORDS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if engine not in REPLAY_ENGINE_CHOICES:
            raise ValueError(f"unknown replay engine {engine!r}; choose one of {', '.join(REPLAY_ENGINE_CHOICES)}")
        self.engine = engine
        self.direct_max_records = direct_max_records
        self.take_definition(definition, pipeline_config)
        self.postgres_conn_id = postgres_conn_id
        self.kafka_config_id = kafka_config_id
        self.spark_conn_id = spark_conn_id
        self.jars = jars
        self.spark_conf = spark_conf
        self.driver_memory = driver_memory
        self.checkpoint_dir = checkpoint_dir
        self.kafka_options = kafka_options
        self.require_stop_request = require_stop_request
        self.hold_lock = hold_lock
        self.lock_ttl = lock_ttl
        self.plan_only = plan_only
        self.pg_bin_dir = pg_bin_dir
        self._launcher: AppLauncher | None = None

    def _row_counts(self, config: Any) -> dict[str, int]:
        from spark_apps.eos_stream.records.spec import RowTarget, spec_of
        from spark_apps.eos_stream.state import meta_tables

        spec = spec_of(config)
        # A row target's rows are its events; a mirror's tables grow by inserts only (updates and
        # deletes are changes too: ``offsets_replayed`` counts those).
        tables = [(config.target_schema, t.table) for t in spec.targets if isinstance(t, RowTarget)]
        if spec.mirror is not None:
            tables += [(config.target_schema, table) for table in spec.mirror.target_tables()]
        tables.append((config.meta_schema, meta_tables.DEAD_LETTERS))
        conn = self.hook.connect()
        try:
            with conn.cursor() as cur:
                counts = {}
                for schema, table in tables:
                    cur.execute(sql.SQL("SELECT count(*) FROM {}.{}").format(
                        sql.Identifier(schema), sql.Identifier(table)))
                    counts[f"{schema}.{table}"] = int((cur.fetchone() or (0,))[0])
                return counts
        finally:
            conn.close()

    def _stored(self, config: Any) -> dict[tuple[str, int], int]:
        conn = self.hook.connect()
        try:
            return stored_offsets_in(conn, config.meta_schema, config.pipeline)
        finally:
            conn.close()

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.app_config()
        started = time.monotonic()
        before = self._stored(config)
        retention = self.check_retention(before, subscribed_topics(config), "from the restored offsets")
        lso_at_start = from_nested(retention["last_stable"])
        # Chosen from the retention check's count: no second look at Kafka.
        choice = choose_replay_engine(self.engine, retention.get("records_to_replay"), self.direct_max_records)
        self.log.info("replay engine %s (asked %s): %s records to replay, direct up to %s: %s", choice.engine,
                      choice.asked, choice.records_to_replay, choice.direct_max_records, choice.reason)
        plan = {"offsets_before": to_nested(before), "retention": retention, "engine": choice.as_dict()}
        if as_bool(self.plan_only):
            return Replayed(dry_run=True, details=plan).to_xcom()
        with self.lock_guard(config, context):
            if self.require_stop_request:
                stopped_at = stream_activity(self.hook, config.pipeline).get("stop_requested_at")
                if stopped_at is None:
                    raise PipelineNotStoppedError(
                        f"pipeline {config.pipeline!r} has no stop request: a supervisor could start a driver "
                        "that fights the replay for the target. Stop it first (the recovery's stop_stream step).")
            counts_before = self._row_counts(config)
            self._run_engine(choice.engine, self.replay_config(config))
        after = self._stored(config)
        behind = {f"{t}[{p}]": lso - after.get((t, p), 0) for (t, p), lso in lso_at_start.items()
                  if after.get((t, p), 0) < lso}
        if behind:
            raise AirflowException(f"replay finished but did not reach the last stable offsets: behind by {behind}")
        counts_after = self._row_counts(config)
        rows_added = {k: counts_after[k] - counts_before.get(k, 0) for k in counts_after}
        # Records (and transaction markers) the replay moved the stored offsets past: for a mirror,
        # whose updates and deletes add no row, the measure of what it replayed.
        offsets_replayed = sum(offset - before.get(tp, 0) for tp, offset in after.items())
        result = Replayed(lso_at_start=lso_at_start, events_replayed=sum(rows_added.values()), details={
            **plan, "offsets_after": to_nested(after), "rows_added": rows_added, "offsets_replayed": offsets_replayed,
            "seconds": round(time.monotonic() - started, 3)}).to_xcom()
        self.log.info("replay done: %s", {k: v for k, v in result.items() if k != "retention"})
        return result

    def replay_config(self, config: PipelineConfig) -> PipelineConfig:
        """The replay run's complete config: the pipeline's, run once to the end, past the stop request."""
        return replace(
            config,
            # The Spark app, run once to the end (the direct replay reads neither key).
            engine="spark", trigger="availableNow", run_seconds=0,
            # The stop request keeps supervisors off the target; only this run may write through it.
            ignore_stop_request=True,
            checkpoint_dir=self.checkpoint_dir or config.checkpoint_dir,
            kafka_options={**config.kafka_options, **(self.kafka_options or {})},
        ).validate()

    def _run_engine(self, engine: str, config: PipelineConfig) -> None:
        """The replay by its engine's launcher: ``direct`` in this process (no spark-submit, the same
        claim and sink as the app), ``spark`` the app under spark-submit."""
        from airflow_provider_eos.launchers.choose import launcher_for
        from airflow_provider_eos.launchers.protocol import run_to_end
        from airflow_provider_eos.launchers.spark_submit import SparkSubmission

        submission = SparkSubmission(conn_id=self.spark_conn_id, jars=self.jars,
                                     conf={**DEFAULT_SPARK_CONF, **(self.spark_conf or {})},
                                     extra={"driver_memory": self.driver_memory,
                                            "name": f"eos-replay-{config.pipeline}"})
        self._launcher = launcher = launcher_for(engine, submission)
        result = run_to_end(launcher, config, log=self.log)
        what = "direct replay" if engine == "direct" else "replay run"
        if not result.ok:
            error = result.last_error
            detail = error["message"] if engine == "direct" and error else result.reason()
            raise AirflowException(f"{what} of pipeline {config.pipeline!r} failed: {detail}") \
                from getattr(launcher, "error", None)
        self.log.info("%s of pipeline %s %s in %.1fs", what, config.pipeline, result.reason(), result.duration_s)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Replayed from the pipeline's topics into its target tables."""
        return self.pipeline_lineage(write=True)

    def on_kill(self) -> None:
        if self._launcher is not None:
            self._launcher.stop()
