"""One pipeline, defined once: a typed model, validated once, loaded from the deployment.

A deployment keeps one file per pipeline in the directory that ``[eos] pipeline_config_dir``
names, ``<name>.yaml`` (or ``.yml``/``.json``; JSON is YAML). The DAG factory reads the
directory when the DAG processor parses the DAG file, and passes each pipeline's validated
definition to its tasks, so a worker runs exactly what the scheduler showed and never reads
the directory again. Why files and not an Airflow Variable: the definitions are code the
team reviews and deploys with its DAGs (git-sync, an image), they are needed at parse time
(a Variable read at parse time queries the metadata database on every parse), and a file per
pipeline lets teams own their pipelines separately.

Nothing here imports Airflow: the model is pure data plus validation.

One shape: the app's ``PipelineConfig`` (spark_apps/eos_stream/config.py) is the single
source of a pipeline's app fields and their defaults, because the app runs on Spark
without Airflow or pydantic. This model restates each of those fields for validation and
documentation, under the same name (the app's ``pipeline`` is ``name`` here), at the top
level or in ``stream``, with the app's default read from ``default_of``; it adds only what
the app never sees (connections, schedules, restart policy, snapshots, health; see
``DEFINITION_ONLY``). :meth:`PipelineDefinition.app_config` walks the app's fields, so a
field added to the app without a place here fails at once, and
tests/unit/test_pipeline_shape.py fails when a name, a type or a default disagrees.
The stream operator takes this definition (operators/stream.py), not the fields one by one.

Example ``payments.yaml``::

    name: payments
    topics: [payments.events]
    spec: my_company.specs.payments:PAYMENTS
    delivery: exactly_once
    target_schema: payments
    meta_schema: payments_eos
    checkpoint_dir: s3a://bucket/checkpoints/payments
    connections: {kafka: kafka_payments, postgres: pg_payments}
    stream: {trigger: processingTime, trigger_interval: 5 seconds}
    snapshot: {schedule: "@hourly", keep_last: 48}
    health: {schedule: "*/5 * * * *", hanging_after: 900}
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from airflow_provider_eos.recovery.replay_engine import (
    DEFAULT_DIRECT_MAX_RECORDS,
    DEFAULT_REPLAY_ENGINE,
    REPLAY_ENGINE_CHOICES,
)
from airflow_provider_eos.utils.definition_checks import definition_problems, schedule_problem
from spark_apps.eos_stream.config import (
    DELIVERY_MODES,
    PIPELINE_NAME,
    TRIGGERS,
    default_of,
    pipeline_fields,
    removed_option_problem,
)

SUFFIXES = (".yaml", ".yml", ".json")
# module.path:ATTRIBUTE, as the app's spec loader takes it.
SPEC_REFERENCE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
# A schema name the app quotes as an identifier; kept plain so it reads the same everywhere.
SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


class PipelineDefinitionError(ValueError):
    """A pipeline definition is missing or wrong; the message names the file and the field."""


class _Section(BaseModel):
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


class ConnectionIds(_Section):
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


class StreamSettings(_Section):
    """How the stream runs.

    :param trigger: ``processingTime`` runs until stopped; ``availableNow`` processes what the
        topics hold and ends (give it a ``schedule`` to run it periodically).
    :param schedule: the stream DAG's schedule (cron or preset); ``None``: triggered by hand or
        by a recovery's resume. A continuous stream is started once and runs until stopped.
    :param replay_engine: how a recovery replays: ``auto`` (``direct`` up to
        ``replay_direct_max_records`` records to replay, ``spark`` above), ``spark`` (the app,
        spark-submit) or ``direct`` (in the Airflow worker, without Spark: seconds instead of a
        cold start; docs/recovery.md).
    :param replay_direct_max_records: ``auto``'s threshold: the most records a replay takes
        ``direct`` for (0: ``spark`` for any replay with records); the default's measurements are in
        airflow_provider_eos/recovery/replay_engine.py.
    """

    # The app's fields: their defaults are the app's.
    trigger: str = default_of("trigger")
    trigger_interval: str = default_of("trigger_interval")
    max_offsets_per_trigger: PositiveInt = default_of("max_offsets_per_trigger")
    driver_write_max_records: NonNegativeInt = default_of("driver_write_max_records")
    max_batch_attempts: PositiveInt = default_of("max_batch_attempts")
    transient_retry_seconds: NonNegativeFloat = default_of("transient_retry_seconds")
    create_targets: bool = default_of("create_targets")
    # The supervisor's and the DAGs' own: the app never sees them.
    max_restarts: NonNegativeInt = 3
    restart_backoff: NonNegativeFloat = 10
    schedule: str | None = None
    replay_engine: str = DEFAULT_REPLAY_ENGINE
    replay_direct_max_records: NonNegativeInt = DEFAULT_DIRECT_MAX_RECORDS

    @model_validator(mode="before")
    @classmethod
    def _no_removed_switch(cls, data: Any) -> Any:
        # Said by name: "extra fields not permitted" would not tell a user that the switch is gone.
        problem = removed_option_problem(data) if isinstance(data, Mapping) else None
        if problem:
            raise ValueError(problem)
        return data

    @field_validator("trigger", "replay_engine")
    @classmethod
    def _one_of_the_choices(cls, value: str, info: ValidationInfo) -> str:
        choices = _STREAM_CHOICES[info.field_name or ""]
        if value not in choices:
            raise ValueError(f"unknown {info.field_name} {value!r}; choose one of {', '.join(choices)}")
        return value


_STREAM_CHOICES = {"trigger": TRIGGERS, "replay_engine": REPLAY_ENGINE_CHOICES}


class SnapshotSettings(_Section):
    """Scheduled snapshots of the targets with their replay point (``schedule: null``: none)."""

    schedule: str | None = "@hourly"
    keep_last: PositiveInt = 24


class HealthSettings(_Section):
    """The scheduled health check.

    :param stuck_after: seconds a partition's LSO may stay behind its high watermark before it
        counts as stuck (an open transaction).
    :param hanging_after: seconds stuck, measured across health-check runs, after which the
        transaction counts as hanging and needs a person; Kafka aborts a live producer's
        transaction after ``transaction.max.timeout.ms`` (15 minutes by default).
    :param max_age_seconds: liveness: the newest batch may be this old.
    :param max_lag: caught up: records per partition still to read.
    :param prepared_older_than: seconds after which a prepared (two-phase) transaction is in doubt.
    """

    schedule: str | None = "*/5 * * * *"
    stuck_after: PositiveFloat = 60
    hanging_after: PositiveFloat = 900
    max_age_seconds: PositiveFloat = 300
    max_lag: NonNegativeInt = 0
    prepared_older_than: NonNegativeFloat = 60
    poke_interval: PositiveFloat = 10
    sensor_timeout: PositiveFloat = 120


class SparkSettings(_Section):
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


class AirflowSettings(_Section):
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


class PipelineDefinition(_Section):
    """Everything the provider needs to know about one pipeline.

    :param name: keys offsets, progress, locks, snapshots and the DAG ids.
    :param topics: Kafka topics the stream reads (``read_committed``).
    :param spec: ``module:ATTRIBUTE`` of the app's PipelineSpec (what the records hold and
        which targets they feed).
    :param delivery: one of the app's delivery modes.
    :param target_schema: schema of the target tables.
    :param meta_schema: schema of the bookkeeping tables (offsets, epochs, dead letters...).
    :param checkpoint_dir: Spark checkpoint root (any Hadoop-compatible path).
    """

    name: str
    topics: list[str] = Field(min_length=1)
    spec: str
    delivery: str = default_of("delivery")
    target_schema: str = default_of("target_schema")
    meta_schema: str = default_of("meta_schema")
    # Required here though the app has a local default: a deployment names durable storage.
    checkpoint_dir: str
    connections: ConnectionIds = ConnectionIds()
    stream: StreamSettings = StreamSettings()
    snapshot: SnapshotSettings = SnapshotSettings()
    health: HealthSettings = HealthSettings()
    spark: SparkSettings = SparkSettings()
    airflow: AirflowSettings = AirflowSettings()

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not PIPELINE_NAME.fullmatch(value):
            raise ValueError(f"{value!r} must be 1-100 letters, digits, '_', '-' or '.', starting with a letter "
                             "or digit")
        return value

    @field_validator("topics")
    @classmethod
    def _distinct_topics(cls, value: list[str]) -> list[str]:
        if any(not topic or topic.strip() != topic for topic in value) or len(set(value)) != len(value):
            raise ValueError(f"topics must be distinct non-empty names without spaces, not {value!r}")
        return value

    @field_validator("spec")
    @classmethod
    def _spec_reference(cls, value: str) -> str:
        if not SPEC_REFERENCE.fullmatch(value):
            raise ValueError(f"{value!r} must look like package.module:ATTRIBUTE")
        return value

    @field_validator("delivery")
    @classmethod
    def _known_delivery(cls, value: str) -> str:
        if value not in DELIVERY_MODES:
            raise ValueError(f"unknown delivery mode {value!r}; choose one of {', '.join(DELIVERY_MODES)}")
        return value

    @field_validator("target_schema", "meta_schema")
    @classmethod
    def _plain_schema(cls, value: str) -> str:
        if not SCHEMA_NAME.fullmatch(value):
            raise ValueError(f"{value!r} must be a lower-case PostgreSQL name (letters, digits, '_')")
        return value

    def app_fields(self) -> dict[str, Any]:
        """The app's pipeline fields (``pipeline_fields``), each read from where this model keeps it."""
        return {key: _copy(getattr(self.stream if place == "stream" else self, name))
                for key, (place, name) in app_field_places().items()}

    def app_config(self, *, kafka_bootstrap: str, postgres: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
        """The streaming app's config (``spark_apps.eos_stream.config.PipelineConfig`` as a dict).

        :param kafka_bootstrap: from the pipeline's Kafka connection.
        :param postgres: host, port, dbname, user from its Postgres connection (never the password:
            that travels in the app's environment).
        :param overrides: app keys a run sets (``run_seconds``, ``ignore_stop_request``...).
        """
        if "password" in postgres:
            raise PipelineDefinitionError("the database password never goes into the app's config")
        config: dict[str, Any] = self.app_fields()
        config.update(kafka_bootstrap=kafka_bootstrap, postgres=dict(postgres))
        config.update(overrides)
        return config


# The app's field names this model spells differently.
APP_FIELD_RENAMES = {"pipeline": "name"}
# What a definition holds that the app never sees, by place.
DEFINITION_ONLY = {"top": ("connections", "stream", "snapshot", "health", "spark", "airflow"),
                   "stream": ("max_restarts", "restart_backoff", "schedule", "replay_engine",
                              "replay_direct_max_records")}


def app_field_places() -> dict[str, tuple[str, str]]:
    """Each app pipeline field's place in the definition: ("top" or "stream", its name there).

    :raises LookupError: an app field has no place here (added to the app, forgotten here)."""
    places: dict[str, tuple[str, str]] = {}
    for key in pipeline_fields():
        name = APP_FIELD_RENAMES.get(key, key)
        if name in PipelineDefinition.model_fields:
            places[key] = ("top", name)
        elif name in StreamSettings.model_fields:
            places[key] = ("stream", name)
        else:
            raise LookupError(f"the app's field {key!r} has no place in PipelineDefinition")
    return places


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def parse_definition(data: Any, *, source: str) -> PipelineDefinition:
    """A validated definition from parsed YAML/JSON; errors name ``source`` and each bad field."""
    if not isinstance(data, Mapping):
        raise PipelineDefinitionError(f"{source}: a pipeline definition is a mapping, not {type(data).__name__}")
    try:
        return PipelineDefinition.model_validate(dict(data))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or '(top)'}: {error['msg']}" for error in exc.errors()
        )
        raise PipelineDefinitionError(f"{source}: invalid pipeline definition: {problems}") from None


def load_definition(path: str | Path) -> PipelineDefinition:
    """The definition in one file, whose stem must be the pipeline's name."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PipelineDefinitionError(f"cannot read pipeline definition {path}: {exc}") from exc
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise PipelineDefinitionError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") \
            from None
    definition = parse_definition(data, source=str(path))
    if definition.name != path.stem:
        # The name picks the file when a task looks a pipeline up: they must agree.
        raise PipelineDefinitionError(f"{path}: defines pipeline {definition.name!r}; name the file "
                                      f"{definition.name}{path.suffix} or change its name to {path.stem!r}")
    return definition


def definition_files(directory: str | Path) -> list[Path]:
    """The definition files in ``directory`` (not hidden, not in subdirectories), sorted."""
    root = Path(directory)
    if not root.is_dir():
        raise PipelineDefinitionError(f"the pipeline definition directory {root} does not exist "
                                      "(set [eos] pipeline_config_dir)")
    return sorted(p for p in root.iterdir()
                  if p.suffix in SUFFIXES and p.is_file() and not p.name.startswith("."))


def load_definitions(directory: str | Path) -> tuple[dict[str, PipelineDefinition], dict[str, str]]:
    """Every pipeline in ``directory``: (valid definitions by name, error by file name).

    One bad file never hides the others: each pipeline is independent, and its team sees its
    own error. Two files for one name (``a.yaml`` and ``a.json``) are both refused, and so are
    a definition whose spec does not import and two pipelines that share a target table, a
    meta schema or a checkpoint directory (``definition_checks``)."""
    found: dict[str, PipelineDefinition] = {}
    paths: dict[str, Path] = {}
    errors: dict[str, str] = {}
    files = definition_files(directory)
    stems = [p.stem for p in files]
    for path in files:
        if stems.count(path.stem) > 1:
            errors[path.name] = f"{path}: more than one definition file for pipeline {path.stem!r}"
            continue
        try:
            found[path.stem] = load_definition(path)
            paths[path.stem] = path
        except PipelineDefinitionError as exc:
            errors[path.name] = str(exc)
    for name, problems in definition_problems(found).items():
        errors[paths[name].name] = f"{paths[name]}: invalid pipeline definition: {'; '.join(problems)}"
        del found[name]
    return found, errors


def find_definition(directory: str | Path, name: str) -> PipelineDefinition:
    """The one pipeline called ``name``; the error lists the pipelines that do exist."""
    if not PIPELINE_NAME.fullmatch(name):
        raise PipelineDefinitionError(f"invalid pipeline name {name!r}")
    candidates = [Path(directory) / f"{name}{suffix}" for suffix in SUFFIXES]
    present = [p for p in candidates if p.is_file()]
    if len(present) == 1:
        return load_definition(present[0])
    if present:
        raise PipelineDefinitionError(f"more than one definition file for pipeline {name!r}: "
                                      f"{', '.join(str(p) for p in present)}")
    known = sorted({p.stem for p in definition_files(directory)})
    raise PipelineDefinitionError(f"no pipeline {name!r} in {directory}"
                                  + (f"; defined there: {', '.join(known)}" if known else ""))
