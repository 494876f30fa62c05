"""The sections of a pipeline definition that the app never sees: connections, snapshots, the
health check, Spark submission and Airflow task settings (see ``pipeline_definition``).

Nothing here imports Airflow.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from airflow_provider_eos.utils.cdc_health import (
    DEFAULT_KAFKA_CONNECT_CONN_ID,
    DEFAULT_MAX_AGE_SECONDS,
    DEFAULT_MAX_HELD_BYTES,
)
from airflow_provider_eos.utils.schedules import schedule_problem

# A PostgreSQL replication slot's name, as the server accepts it (Debezium's ``slot.name``).
SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")
# module.path:ATTRIBUTE, as the app's spec loader takes it.
SPEC_REFERENCE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


class Section(BaseModel):
    """A part of a definition: unknown keys refused, frozen once validated; a ``schedule`` is
    checked as Airflow would (here, naming the file and the field, not as a DAG import error)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("schedule", check_fields=False)
    @classmethod
    def _airflow_schedule(cls, value: str | None) -> str | None:
        # Checked here, not when the DAG is built: there a bad cron string is an import error of
        # the DAG file that names neither the definition file nor the field.
        problem = schedule_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class ConnectionIds(Section):
    """Airflow connection ids; ``None`` takes the deployment's default (``[eos] *_conn_id``)."""

    kafka: str | None = None
    postgres: str | None = None
    spark: str | None = None

    def resolved(self, defaults: Mapping[str, str]) -> ResolvedConnections:
        """These ids with every unset one taken from ``defaults`` (keys kafka, postgres, spark)."""
        return ResolvedConnections(**{key: getattr(self, key) or defaults[key] for key in ResolvedConnections._fields})


class ResolvedConnections(NamedTuple):
    """The connection ids a pipeline's tasks use, every one set."""

    kafka: str
    postgres: str
    spark: str


class SnapshotSettings(Section):
    """Scheduled snapshots of the targets with their replay point (``schedule: null``: none)."""

    schedule: str | None = "@hourly"
    keep_last: PositiveInt = 24


class HealthSettings(Section):
    """The scheduled health check.

    :param stuck_after: seconds a partition's LSO may stay behind its high watermark before it
        counts as stuck (an open transaction).
    :param hanging_after: seconds stuck, measured across health-check runs, after which the
        transaction counts as hanging and needs a person; Kafka aborts a live producer's
        transaction after ``transaction.max.timeout.ms`` (15 minutes by default).
    :param max_age_seconds: liveness: the newest batch may be this old.
    :param max_lag: caught up: records per partition still to read.
    :param prepared_older_than: seconds after which a prepared (two-phase) transaction is in doubt.
    :param max_transaction_wait: a mirror with ``transactions: whole``: seconds a source
        transaction's changes may wait for its ``END`` (the check ``held_transactions``).
    """

    schedule: str | None = "*/5 * * * *"
    stuck_after: PositiveFloat = 60
    hanging_after: PositiveFloat = 900
    max_age_seconds: PositiveFloat = 300
    max_lag: NonNegativeInt = 0
    prepared_older_than: NonNegativeFloat = 60
    max_transaction_wait: PositiveFloat = 300
    poke_interval: PositiveFloat = 10
    sensor_timeout: PositiveFloat = 120


class CdcSourceSettings(Section):
    """The change-data-capture source of a pipeline that reads Debezium's change topics: its
    health DAG also checks the connectors and the source's replication slots (docs/cdc.md).

    :param connectors: the Kafka Connect connectors that publish the pipeline's topics; each one
        and every one of its tasks must be RUNNING.
    :param kafka_connect_conn_id: the Airflow connection to Connect's REST API.
    :param replication_slots: the source's slots the connectors read through (Debezium's
        ``slot.name``); each must exist and hold back less than the limits below.
    :param source_postgres_conn_id: the Airflow connection to the source database (the slots are
        per database); its role needs ``pg_monitor`` for the age of the WAL a slot holds.
    :param max_held_bytes: WAL a slot may hold back (current LSN minus its ``restart_lsn``).
    :param max_held_age_seconds: age the oldest WAL a slot holds may reach; null: bytes only.
    """

    connectors: list[str]
    kafka_connect_conn_id: str = DEFAULT_KAFKA_CONNECT_CONN_ID
    replication_slots: list[str] = []
    source_postgres_conn_id: str | None = None
    max_held_bytes: PositiveInt = DEFAULT_MAX_HELD_BYTES
    max_held_age_seconds: PositiveFloat | None = DEFAULT_MAX_AGE_SECONDS

    @field_validator("connectors", "replication_slots")
    @classmethod
    def _distinct_names(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"named more than once: {', '.join(repeated)}")
        if any(not name.strip() for name in value):
            raise ValueError("a name is empty")
        return value

    @field_validator("connectors")
    @classmethod
    def _some_connector(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one connector")
        return value

    @field_validator("replication_slots")
    @classmethod
    def _slot_names(cls, value: list[str]) -> list[str]:
        bad = [name for name in value if not SLOT_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"{bad} are no replication slot names (lower-case letters, digits, '_', at most 63)")
        return value

    @model_validator(mode="after")
    def _source_for_slots(self) -> CdcSourceSettings:
        if self.replication_slots and not self.source_postgres_conn_id:
            raise ValueError("replication_slots needs source_postgres_conn_id: the slots are in the source "
                             "database, not the pipeline's target")
        return self


class SparkSettings(Section):
    """The pipeline's spark-submits (its stream, and its recovery's replay on the ``spark`` engine).

    :param conf: more Spark properties (``spark.*``); the resources below win over the same keys.
    :param driver_memory: ``--driver-memory``.
    :param driver_cores: ``spark.driver.cores`` (cluster deploy mode).
    :param executor_memory: ``spark.executor.memory``.
    :param executor_cores: ``spark.executor.cores``.
    :param num_executors: ``spark.executor.instances`` (YARN, Kubernetes).
    :param max_cores: ``spark.cores.max`` (standalone: the cores the application takes in all).
    :param packages: Maven coordinates, ``spark.jars.packages`` (resolved by the cluster's Ivy).
    :param jars: more jars, after the deployment's ``[eos] spark_jars`` (the Kafka connector).
    """

    conf: dict[str, str] = {}
    driver_memory: str = "1g"
    driver_cores: PositiveInt | None = None
    executor_memory: str | None = None
    executor_cores: PositiveInt | None = None
    num_executors: PositiveInt | None = None
    max_cores: PositiveInt | None = None
    packages: list[str] = []
    jars: list[str] = []

    def submit_conf(self) -> dict[str, str]:
        """``conf`` with the resources and packages as the Spark properties they are."""
        resources = {"spark.driver.cores": self.driver_cores, "spark.executor.memory": self.executor_memory,
                     "spark.executor.cores": self.executor_cores, "spark.executor.instances": self.num_executors,
                     "spark.cores.max": self.max_cores,
                     "spark.jars.packages": ",".join(self.packages) or None}
        return {**self.conf, **{key: str(value) for key, value in resources.items() if value is not None}}

    def all_jars(self, deployment_jars: str | None) -> str | None:
        """The deployment's jars (``[eos] spark_jars``), then this pipeline's."""
        jars = [j for j in (deployment_jars or "").split(",") if j] + self.jars
        return ",".join(jars) or None


class AirflowSettings(Section):
    """How the pipeline's tasks run in Airflow; unset means Airflow's own default.

    :param owner: every task's ``owner``.
    :param queue: every task's executor queue (Celery, Kubernetes executor's queues...).
    :param spark_queue: the queue of the tasks that spark-submit (the stream, a Spark replay); only
        workers of that queue need pyspark and Java (docs/deployment.md). Default: ``queue``.
    :param pool: every task's pool.
    :param retries: every task's retries (the stream's supervisor restarts the app itself).
    :param retry_delay_seconds: seconds between retries.
    :param tags: added to each DAG's tags.
    :param on_failure_callback: ``module:function`` called when a task fails.
    :param on_retry_callback: ``module:function`` called when a task is retried.
    :param on_success_callback: ``module:function`` called when a task succeeds.
    """

    owner: str | None = None
    queue: str | None = None
    spark_queue: str | None = None
    pool: str | None = None
    retries: NonNegativeInt | None = None
    retry_delay_seconds: NonNegativeFloat | None = None
    tags: list[str] = []
    on_failure_callback: str | None = None
    on_retry_callback: str | None = None
    on_success_callback: str | None = None

    @field_validator("on_failure_callback", "on_retry_callback", "on_success_callback")
    @classmethod
    def _callback_reference(cls, value: str | None) -> str | None:
        if value is not None and not SPEC_REFERENCE.fullmatch(value):
            raise ValueError(f"{value!r} must look like package.module:function")
        return value

    def callbacks(self) -> dict[str, str]:
        """The callbacks that are set, by their task argument."""
        return {key: getattr(self, key) for key in ("on_failure_callback", "on_retry_callback", "on_success_callback")
                if getattr(self, key)}
