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

One shape: the app's ``PipelineConfig`` (spark_apps/eos_stream/run/config.py) is the single
source of a pipeline's app fields and their defaults, because the app runs on Spark
without Airflow or pydantic. This model restates each of those fields for validation and
documentation, under the same name (the app's ``pipeline`` is ``name`` here), at the top
level or in ``stream``, with the app's default read from ``default_of``; it adds only what
the app never sees (connections, schedules, restart policy, snapshots, health; see
``DEFINITION_ONLY``). :meth:`PipelineDefinition.app_config` walks the app's fields, so a
field added to the app without a place here fails at once, and
tests/unit/test_pipeline_shape.py fails when a name, a type or a default disagrees. Their
values are not checked here but by the app's own list of refusals (``config_rules``), run on
the app config this definition yields when it is built: one set of rules, in the app's words.
The stream operator takes this validated definition (operators/stream.py), not the fields one
by one, and never parses it again: a run's tuning of ``stream`` goes through :meth:`tuned`.

Example ``payments.yaml``::

    name: payments
    topics: [payments.events]
    spec: my_company.specs.payments:PAYMENTS
    delivery: exactly_once
    target_schema: payments
    meta_schema: payments_eos
    checkpoint_dir: s3a://bucket/checkpoints/payments
    connections: {kafka: kafka_payments, postgres: pg_payments}
    stream: {trigger: processingTime, trigger_interval: 1 second}
    snapshot: {schedule: "@hourly", keep_last: 48}
    health: {schedule: "*/5 * * * *", hanging_after: 900}
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

from pydantic import (
    BaseModel,
    NonNegativeFloat,
    NonNegativeInt,
    ValidationError,
    field_validator,
    model_validator,
)

from airflow_provider_eos.utils.definition_sections import (
    SPEC_REFERENCE,
    AirflowSettings,
    CdcSourceSettings,
    ConnectionIds,
    HealthSettings,
    Section,
    SnapshotSettings,
    SparkSettings,
)
from airflow_provider_eos.utils.replay_engine import (
    DEFAULT_DIRECT_MAX_RECORDS,
    DEFAULT_REPLAY_ENGINE,
    REPLAY_ENGINE_CHOICES,
)
from spark_apps.eos_stream.known_keys import unknown_key_message
from spark_apps.eos_stream.run.config import (
    LEGACY_MIRROR_PREFIX,
    ConfigError,
    PipelineConfig,
    PostgresTarget,
    default_of,
    legacy_mirror,
    pipeline_fields,
    read_deprecated_trigger,
    removed_option_problem,
)
from spark_apps.eos_stream.run.config_rules import refusals

# A schema name the app quotes as an identifier; kept plain so it reads the same everywhere.
SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


# What a definition without a spec or a mirror section holds until ``spec``'s check refuses it.
_NO_SPEC = object()


class PipelineDefinitionError(ValueError):
    """A pipeline definition is missing or wrong; the message names the file and the field."""


class StreamSettings(Section):
    """How the stream runs.

    :param engine: ``spark`` (the default) runs the Spark app under spark-submit, as ``trigger``
        says; ``continuous`` runs the Spark-less engine until stopped, committing every few tens of
        milliseconds (docs/latency.md), and takes no trigger.
    :param trigger: Spark's trigger: ``processingTime`` runs micro-batches until stopped;
        ``availableNow`` processes what the topics hold and ends (give it a ``schedule`` to run it
        periodically). ``continuous`` is read as ``engine: continuous`` for one release, with a warning.
    :param schedule: the stream DAG's schedule (cron or preset); ``None``: triggered by hand or
        by a recovery's resume. A continuous stream is started once and runs until stopped.
    :param replay_engine: how a recovery replays: ``auto`` (``direct`` up to
        ``replay_direct_max_records`` records to replay, ``spark`` above), ``spark`` (the app,
        spark-submit) or ``direct`` (in the Airflow worker, without Spark: seconds instead of a
        cold start; docs/recovery.md).
    :param replay_direct_max_records: ``auto``'s threshold: the most records a replay takes
        ``direct`` for (0: ``spark`` for any replay with records); the default's measurements are in
        airflow_provider_eos/utils/replay_engine.py.
    """

    # The app's fields: their defaults are the app's.
    engine: str = default_of("engine")
    trigger: str = default_of("trigger")
    trigger_interval: str = default_of("trigger_interval")
    max_offsets_per_trigger: int = default_of("max_offsets_per_trigger")
    continuous_linger_ms: int = default_of("continuous_linger_ms")
    continuous_max_bytes: int = default_of("continuous_max_bytes")
    driver_write_max_records: int = default_of("driver_write_max_records")
    max_batch_attempts: int = default_of("max_batch_attempts")
    transient_retry_seconds: float = default_of("transient_retry_seconds")
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
        if not isinstance(data, Mapping):
            return data
        problem = removed_option_problem(data)
        if problem:
            raise ValueError(problem)
        return read_deprecated_trigger(data)

    @field_validator("replay_engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        if value not in REPLAY_ENGINE_CHOICES:
            raise ValueError(f"unknown replay_engine {value!r}; choose one of {', '.join(REPLAY_ENGINE_CHOICES)}")
        return value


class PipelineDefinition(Section):
    """Everything the provider needs to know about one pipeline.

    :param name: keys offsets, progress, locks, snapshots and the DAG ids.
    :param topics: Kafka topics the stream reads (``read_committed``).
    :param spec: ``module:ATTRIBUTE`` of the app's PipelineSpec (what the records hold and
        which targets they feed); a mirror pipeline gives ``mirror`` instead.
    :param mirror: a mirror pipeline's tables (docs/cdc.md), checked by the app's own parser
        (``cdc.definition.parse_mirror``) when the definition loads: every error, an unknown key
        at any level too, named by its place. The app gets it as its config's ``mirror``. The
        earlier ``spec: "mirror:<file or inline JSON>"`` is read into it, for one release.
    :param delivery: one of the app's delivery modes.
    :param target_schema: schema of the target tables.
    :param meta_schema: schema of the bookkeeping tables (offsets, epochs, dead letters...).
    :param checkpoint_dir: Spark checkpoint root (any Hadoop-compatible path).
    :param cdc: the change-data-capture source behind the topics (Kafka Connect connectors, the
        source's replication slots), which the health DAG then checks too; None: no such checks.
    """

    name: str
    topics: list[str]
    spec: str | None = default_of("spec")
    mirror: dict[str, Any] | None = default_of("mirror")
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
    cdc: CdcSourceSettings | None = None

    @model_validator(mode="before")
    @classmethod
    def _mirror_section(cls, data: Any) -> Any:
        """The ``mirror`` section checked as the app parses it, before pydantic's own check, so that
        its errors name their place as the app's parser does (``_check_mirror``). A spec of the
        earlier shape (``mirror:<file or inline JSON>``) is read into the section here."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        spec = data.get("spec")
        if isinstance(spec, str) and spec.startswith(LEGACY_MIRROR_PREFIX):
            try:
                data["mirror"] = legacy_mirror(data.pop("spec"), data.get("mirror"))
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        elif data.get("spec") is not None and data.get("mirror") is not None:
            raise ValueError("a definition names either a spec or a mirror section, not both")
        if data.get("mirror") is not None:
            _check_mirror(data["mirror"])
        elif data.get("spec") is None:
            data["spec"] = _NO_SPEC  # refused by the field's own check, beside the other fields' errors
        return data

    @field_validator("spec", mode="before")
    @classmethod
    def _spec_reference(cls, value: Any) -> Any:
        if value is _NO_SPEC:
            raise ValueError("required: name the spec (package.module:ATTRIBUTE), or give a mirror section "
                             "(docs/cdc.md)")
        if isinstance(value, str) and not SPEC_REFERENCE.fullmatch(value):
            raise ValueError(f"{value!r} must look like package.module:ATTRIBUTE, or give a mirror section instead")
        return value

    @field_validator("target_schema", "meta_schema")
    @classmethod
    def _plain_schema(cls, value: str) -> str:
        if not SCHEMA_NAME.fullmatch(value):
            raise ValueError(f"{value!r} must be a lower-case PostgreSQL name (letters, digits, '_')")
        return value

    @model_validator(mode="after")
    def _what_the_app_refuses(self) -> PipelineDefinition:
        problem = self.app_refusal()
        if problem:
            raise ValueError(problem)
        return self

    def app_refusal(self) -> str | None:
        """What the app's own list (``config_rules``) refuses in the config this definition yields,
        each named by its place here; None if nothing. The app's fields are checked there, once, in
        the app's words. The rules that need the spec imported run in ``definition_checks`` (eos
        validate, eos preflight, the DAG factory)."""
        found = refusals(self.app_pipeline_config(), load_spec=False)
        places = app_field_places()
        return "; ".join(f"{_place(places[r.rule])}: {r.message}" if r.rule in places else r.message
                         for r in found) or None

    def tuned(self, tuning: Mapping[str, Any] | None) -> PipelineDefinition:
        """This definition with a run's ``stream`` tuning (``None`` values: the definition's), the
        tuned keys and the app's rules checked; the rest is not validated again.

        :raises PipelineDefinitionError: a key is no stream setting, or a value is refused."""
        given = {key: value for key, value in (tuning or {}).items() if value is not None}
        if not given:
            return self
        try:
            # Before the merge: the definition's own engine must not contradict a tuned old spelling.
            given = read_deprecated_trigger(given)
            stream = StreamSettings.model_validate({**self.stream.model_dump(), **given})
        except ValidationError as exc:
            problem: str | None = "; ".join(f"stream.{_problem(e, StreamSettings)}" for e in exc.errors())
        except ConfigError as exc:
            problem = f"stream: {exc}"
        else:
            tuned = self.model_copy(update={"stream": stream})
            problem = tuned.app_refusal()
        if problem:
            raise PipelineDefinitionError(f"pipeline {self.name!r}: this run's tuning {given}: {problem}")
        return tuned

    def app_pipeline_config(self, **run: Any) -> PipelineConfig:
        """The app's ``PipelineConfig`` this definition yields, with a run's fields (``RUN_FIELDS``;
        the app's defaults for the rest) and the app fields a run sets for itself (a replay's
        ``engine``, ``trigger``, ``checkpoint_dir``). The provider's one complete config is
        ``hooks.app_config.complete_app_config``, which fills the run's fields from the connections."""
        postgres = PostgresTarget(**run.pop("postgres", {}) or {})
        return PipelineConfig(**{**self.app_fields(), **run}, postgres=postgres)

    def app_fields(self) -> dict[str, Any]:
        """The app's pipeline fields (``pipeline_fields``), each read from where this model keeps it."""
        return {key: _copy(getattr(self.stream if place == "stream" else self, name))
                for key, (place, name) in app_field_places().items()}

    def app_config(self, *, kafka_bootstrap: str, postgres: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
        """The streaming app's config (``spark_apps.eos_stream.run.config.PipelineConfig`` as a dict).

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
DEFINITION_ONLY = {"top": ("connections", "stream", "snapshot", "health", "spark", "airflow", "cdc"),
                   "stream": ("max_restarts", "restart_backoff", "schedule", "replay_engine",
                              "replay_direct_max_records")}


def _check_mirror(section: Any) -> None:
    """The mirror section checked as the app will parse it, when the definition loads: every
    error (an unknown key at any level too) named by its place, as the other sections' are.

    :raises ValueError: the app would refuse the section."""
    from spark_apps.eos_stream.cdc.definition import parse_mirror
    from spark_apps.eos_stream.cdc.mirror import MirrorError

    if not isinstance(section, Mapping):
        raise ValueError(f"mirror: must be a mapping (topic_prefix, tables...), not {type(section).__name__}")
    try:
        parse_mirror(section)
    except MirrorError as exc:
        raise ValueError(str(exc)) from None


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


def _place(place: tuple[str, str]) -> str:
    return place[1] if place[0] == "top" else f"{place[0]}.{place[1]}"


def _copy(value: Any) -> Any:
    return copy.deepcopy(value) if isinstance(value, (list, dict)) else value


def parse_definition(data: Any, *, source: str) -> PipelineDefinition:
    """A validated definition from parsed YAML/JSON; errors name ``source`` and each bad field."""
    if not isinstance(data, Mapping):
        raise PipelineDefinitionError(f"{source}: a pipeline definition is a mapping, not {type(data).__name__}")
    try:
        return PipelineDefinition.model_validate(dict(data))
    except ValidationError as exc:
        problems = "; ".join(_problem(error) for error in exc.errors())
        raise PipelineDefinitionError(f"{source}: invalid pipeline definition: {problems}") from None


def _problem(error: Any, root: type[BaseModel] | None = None) -> str:
    """One validation error as a user reads it: where, what, and for an unknown key the nearest
    allowed one and the allowed keys there."""
    where = ".".join(str(part) for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        section = _section_at(error["loc"][:-1], root or PipelineDefinition)
        message = unknown_key_message(str(error["loc"][-1]), section.model_fields)
    return f"{where}: {message}" if where else message


def _section_at(path: tuple[Any, ...], model: type[BaseModel]) -> type[BaseModel]:
    """The model that holds the keys at ``path`` under ``model`` (``model`` itself for ``()``)."""
    for part in path:
        annotation = model.model_fields[str(part)].annotation
        # An optional section (``cdc``) is its model or None.
        annotation = next((a for a in get_args(annotation) if a is not type(None)), annotation)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            break
        model = annotation
    return model


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
