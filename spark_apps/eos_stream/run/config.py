"""The app's configuration: a JSON file and/or command-line flags, secrets from env.

Secrets never travel on the command line (where ``ps`` shows them): the
database password comes from ``EOS_PG_PASSWORD`` (or libpq's ``PGPASSWORD``),
extra Kafka client settings such as SASL credentials from
``EOS_KAFKA_OPTIONS_JSON``.

One shape for a pipeline: :class:`PipelineConfig` is the single source of the app's
fields and their defaults. The provider derives its forms from it mechanically:
``PipelineDefinition`` (airflow_provider_eos/utils/pipeline_definition.py) takes each
field in :func:`pipeline_fields` under the same name (``pipeline`` is its ``name``)
with :func:`default_of` as its default, and builds the app's config by walking those
fields; the stream operator takes that definition plus the :data:`RUN_FIELDS` a run
sets. A mirror pipeline's ``mirror`` section is a field of its own, the section as the
definition holds it (plain JSON); the app builds its spec from it once per process
(``records.spec.spec_of``). The source lives here, not in the provider, because the app runs on Spark
without Airflow or pydantic; tests/unit/test_pipeline_shape.py fails when a form
disagrees. What a config may not be is one list, ``config_rules.RULES``: ``validate``,
the app's start and the provider's definition all apply it (config_rules reads the fields
through a protocol and imports nothing of this module). No field defaults to an example
pipeline: ``pipeline`` and ``topics`` are required, and ``spec`` or ``mirror`` (rule ``spec``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from spark_apps.eos_stream.run.config_rules import DEPRECATED_CONTINUOUS_TRIGGER, ConfigError, refuse

# Switches that are gone, with what a config that still sets one is told. Each
# measured slower than the one path that stayed (docs/benchmarks.md, "Removed switches").
REMOVED_OPTIONS = {
    "record_parsing": "Arrow parses records in bulk and parse_record judges the rest; the JVM parser measured 0.72x",
    "write_path": "batches are always staged by the executors and applied in SQL; the direct path was a draw",
}
# How a recovery replays: the app under spark-submit, or direct_replay without Spark.
REPLAY_ENGINES = ("spark", "direct")


# The earlier shape of a mirror pipeline's spec, ``mirror:<file or inline JSON>``: read for one release.
LEGACY_MIRROR_PREFIX = "mirror:"


def legacy_mirror(spec: str, mirror: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``mirror`` section a spec of the earlier shape names (``records.spec.read_mirror_section``).

    :raises ConfigError: the config names a mirror section too, or the reference holds none."""
    from spark_apps.eos_stream.records.spec import SpecError, read_mirror_section

    if mirror is not None:
        raise ConfigError("a pipeline names either a spec or a mirror section, not both")
    try:
        return dict(read_mirror_section(spec.removeprefix(LEGACY_MIRROR_PREFIX)))
    except SpecError as exc:
        raise ConfigError(str(exc)) from None


# libpq keywords that are secrets: they never go into a config file or onto a command line.
SECRET_LIBPQ_OPTIONS = frozenset({"password", "sslpassword"})


@dataclass
class PostgresTarget:
    host: str = "127.0.0.1"
    port: int = 5432
    dbname: str = "postgres"
    user: str = "postgres"
    # Further libpq keywords from the Airflow connection's extras (sslmode,
    # sslrootcert, target_session_attrs, ...), so a remote database that needs
    # TLS is reached the same way by the app as by the provider's own hooks.
    options: dict[str, Any] = field(default_factory=dict)
    # Filled from the environment only; excluded from repr so it never lands in logs.
    password: str | None = field(default=None, repr=False)

    def dsn_kwargs(self) -> dict[str, Any]:
        # TCP keepalives under the options: every session of the app, the executors' COPY
        # sessions included, releases its locks soon after its host vanished (sink/postgres.py).
        from spark_apps.eos_stream.sink.postgres import with_keepalives

        kwargs: dict[str, Any] = with_keepalives({**self.options, "host": self.host, "port": self.port,
                                                  "dbname": self.dbname, "user": self.user})
        if self.password:
            kwargs["password"] = self.password
        return kwargs

    def describe(self) -> str:
        return f"{self.user}@{self.host}:{self.port}/{self.dbname}"


@dataclass
class PipelineConfig:
    """One streaming pipeline.

    :param pipeline: name that keys offsets, progress and dead letters.
    :param topics: Kafka topics to read.
    :param kafka_bootstrap: bootstrap servers.
    :param spec: ``module:ATTRIBUTE`` of the PipelineSpec; None for a mirror pipeline.
    :param mirror: a mirror pipeline's ``mirror`` section (docs/cdc.md), in place of ``spec``.
        The earlier shape, ``spec: "mirror:<file or inline JSON>"``, is read into it when the
        config is built, for one release.
    :param delivery: at_least_once, idempotent, exactly_once or two_phase.
    :param engine: what runs the stream: ``spark`` (the Spark app under spark-submit, its
        micro-batches set by ``trigger``) or ``continuous`` (no Spark: one process commits a cycle
        every few tens of milliseconds until stopped, ``engines/continuous.py``; docs/latency.md).
    :param trigger: Spark's trigger: availableNow (process what is there, exit) or processingTime
        (micro-batches every ``trigger_interval``). The continuous engine takes only the default.
    :param trigger_interval: processingTime interval, e.g. "1 second" (the default; docs/latency.md).
    :param max_offsets_per_trigger: bound on records per micro-batch (continuous: per cycle).
    :param continuous_linger_ms: continuous: how long a cycle keeps polling after its first
        record before it commits (0: it commits what librdkafka had queued). Longer: fewer,
        larger transactions (less database load), each record visible later.
    :param continuous_max_bytes: continuous: a cycle stops reading once its records' keys and
        values reach this many bytes (as ``max_offsets_per_trigger`` bounds its records), and
        its consumer fetches no further ahead: the engine's memory is bounded whatever the
        records' size.
    :param checkpoint_dir: Spark checkpoint root (any Hadoop-compatible path).
    :param target_schema: schema of the target tables.
    :param meta_schema: schema of the bookkeeping tables (offsets, dead letters...).
    :param driver_write_max_records: exactly_once: a batch of at most this many offsets is
        written as one prepared part by the driver itself, without a Spark job (0: always by
        Spark tasks). A Spark job's scheduling is most of a small batch's write, and a stream
        whose batches stay small never starts Python workers (docs/streaming_app.md); a large
        batch is written faster by the tasks in parallel.
    :param max_batch_attempts: failed attempts of one batch before it is
        processed record by record and failing records are quarantined.
    :param create_targets: create the spec's target tables if missing.
    :param run_seconds: a processingTime or continuous run stops by itself after this long (0: never).
    :param stop_poll_seconds: how often the driver looks for a stop request
        and for a changed pipeline epoch (a fenced driver exits within this).
    :param ignore_stop_request: neither check the stop request at start nor
        poll it later. Only for the recovery's replay run: the recovery keeps
        the stop request set for its whole duration, so that no supervisor
        restarts the stream under it, and its own replay must still run.
    :param transient_retry_seconds: total time one batch may spend being
        retried in the driver after transient database errors (lock and
        statement timeouts, deadlocks, lost connections...), with capped
        exponential backoff; after it the driver exits 1 (retryable).
        Transient errors never count toward ``max_batch_attempts``.
    :param kafka_options: extra Kafka client options in librdkafka's names (a Kafka
        connection's extra): security options are translated for Spark's Java source
        (``kafka_security``), others reach it unchanged (without 'kafka.').
    """

    pipeline: str
    topics: list[str]
    spec: str | None = None
    mirror: dict[str, Any] | None = None
    kafka_bootstrap: str = "127.0.0.1:9092"
    delivery: str = "exactly_once"
    engine: str = "spark"
    trigger: str = "processingTime"
    trigger_interval: str = "1 second"
    max_offsets_per_trigger: int = 20000
    continuous_linger_ms: int = 20
    continuous_max_bytes: int = 32 * 1024 * 1024
    driver_write_max_records: int = 5000
    checkpoint_dir: str = "/tmp/eos-checkpoints"
    target_schema: str = "public"
    meta_schema: str = "eos"
    max_batch_attempts: int = 3
    create_targets: bool = False
    run_seconds: float = 0
    stop_poll_seconds: float = 1.0
    ignore_stop_request: bool = False
    transient_retry_seconds: float = 300
    kafka_options: dict[str, str] = field(default_factory=dict, repr=False)  # may hold SASL secrets
    postgres: PostgresTarget = field(default_factory=PostgresTarget)

    def __post_init__(self) -> None:
        # The earlier shape of a mirror (a config written by an earlier release, a hand-written
        # one), read into ``mirror`` here, so no code past this sees a mirror inside ``spec``.
        if isinstance(self.spec, str) and self.spec.startswith(LEGACY_MIRROR_PREFIX):
            self.mirror = legacy_mirror(self.spec, self.mirror)
            self.spec = None

    def validate(self) -> PipelineConfig:
        """This config, or ConfigError naming every rule of its fields it breaks
        (``config_rules``: the one list of what a config may not be)."""
        return refuse(self, load_spec=False)

    def librdkafka_options(self) -> dict[str, str]:
        """The security settings (librdkafka names) for the driver's own clients: metadata,
        audit and Spark-less replay reads; Spark's Java source gets them translated
        (``kafka_security.java_options``)."""
        from spark_apps.eos_stream.kafka.security import security_options

        return security_options(self.kafka_options)

    def redacted(self) -> dict[str, Any]:
        """The config as a dict for logs: no password, Kafka option values hidden."""
        data = asdict(self)
        data["postgres"].pop("password", None)
        data["kafka_options"] = {k: "***" for k in self.kafka_options}
        return data

    def to_json(self) -> str:
        """Serializable form for a config file; never includes secrets."""
        data = asdict(self)
        data["postgres"].pop("password", None)
        data.pop("kafka_options")
        # The fields in their declared order, and a mirror section's keys in its own: the order of a
        # mirror table's columns is the order the app creates them in.
        return json.dumps(data, indent=2)


# The fields a run sets (where Kafka and the database are, how long it runs, how it polls,
# whether it is a recovery's replay), as opposed to what the pipeline is: a pipeline's
# definition holds every other field (see pipeline_fields).
RUN_FIELDS = ("kafka_bootstrap", "postgres", "run_seconds", "stop_poll_seconds", "ignore_stop_request",
              "kafka_options")


def pipeline_fields() -> tuple[str, ...]:
    """The fields that say what a pipeline is, in declaration order: a definition sets them."""
    return tuple(f.name for f in fields(PipelineConfig) if f.name not in RUN_FIELDS)


def required_fields() -> tuple[str, ...]:
    """The fields without a default: every config names them."""
    return tuple(f.name for f in fields(PipelineConfig) if f.default is MISSING and f.default_factory is MISSING)


def default_of(name: str) -> Any:
    """The default of field ``name`` (a fresh one for a list or dict).

    :raises KeyError: no such field, or it is required."""
    for f in fields(PipelineConfig):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise KeyError(f"{name} is required: it has no default")
    raise KeyError(f"PipelineConfig has no field {name!r}")


def removed_option_problem(keys: Any) -> str | None:
    """What to tell a config that sets a removed switch (None: it sets none)."""
    removed = sorted(set(keys) & set(REMOVED_OPTIONS))
    if not removed:
        return None
    return "; ".join(f"{key} was removed ({REMOVED_OPTIONS[key]}): delete it" for key in removed)


def read_deprecated_trigger(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (a config or a definition's ``stream`` section) with ``trigger: continuous`` read as
    ``engine: continuous``, and a FutureWarning naming the fix (shown once per process: Python's
    default filter shows a warning once per place, and it has one). Read for one release; after it,
    the rule on ``trigger`` refuses it.

    :raises ConfigError: ``data`` also names another engine."""
    data = dict(data)
    if data.get("trigger") != DEPRECATED_CONTINUOUS_TRIGGER:
        return data
    engine = data.get("engine", "continuous")
    if engine != "continuous":
        raise ConfigError(f"trigger 'continuous' (the old spelling of engine 'continuous') contradicts engine "
                          f"{engine!r}: remove trigger")
    warnings.warn("trigger: continuous is deprecated and will be refused in the next release; it is read as "
                  "engine: continuous. Write engine: continuous instead (and no trigger).", FutureWarning,
                  stacklevel=1)  # the place is this line, whoever reads the config: one warning per process
    data.update(engine="continuous", trigger=default_of("trigger"))
    return data


def from_dict(data: dict[str, Any]) -> PipelineConfig:
    data = read_deprecated_trigger(data)
    problem = removed_option_problem(data)
    if problem:
        raise ConfigError(problem)
    known = {f.name for f in fields(PipelineConfig)}
    unknown = set(data) - known
    if unknown:
        nearest = {key: difflib.get_close_matches(key, sorted(known), n=1) for key in sorted(unknown)}
        hints = "".join(f"; {key!r}: did you mean {match[0]!r}?" for key, match in nearest.items() if match)
        raise ConfigError(f"unknown config keys {sorted(unknown)}{hints}; known keys: {sorted(known)}")
    data = dict(data)
    pg = data.pop("postgres", {}) or {}
    if "password" in pg:
        raise ConfigError("put the database password in EOS_PG_PASSWORD, not in the config")
    secret_options = SECRET_LIBPQ_OPTIONS & set(pg.get("options") or {})
    if secret_options:
        raise ConfigError(f"postgres.options may not carry secrets ({', '.join(sorted(secret_options))}); "
                          "the password travels in EOS_PG_PASSWORD")
    missing = [name for name in required_fields() if name not in data]
    if missing:
        raise ConfigError(f"missing config keys {missing}: every pipeline names them")
    config = PipelineConfig(**data, postgres=PostgresTarget(**pg))
    return config


def apply_environment(config: PipelineConfig, environ: dict[str, str] | None = None) -> PipelineConfig:
    env = os.environ if environ is None else environ
    config.postgres.password = env.get("EOS_PG_PASSWORD") or env.get("PGPASSWORD") or None
    extra = env.get("EOS_KAFKA_OPTIONS_JSON")
    if extra:
        try:
            config.kafka_options.update(json.loads(extra))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"EOS_KAFKA_OPTIONS_JSON is not valid JSON: {exc}") from exc
    return config


def parse_args(argv: list[str] | None = None) -> PipelineConfig:
    parser = argparse.ArgumentParser(description="Exactly-once Kafka -> Spark -> PostgreSQL stream")
    add_config_arguments(parser)
    return config_from_arguments(parser.parse_args(argv))


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that name a pipeline's config: ``--config`` and ``--set``."""
    parser.add_argument("--config", help="JSON config file (see PipelineConfig)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one key; VALUE is JSON when it parses as JSON; "
                        "postgres.host etc. for the database")


def config_from_arguments(args: argparse.Namespace) -> PipelineConfig:
    """The validated config that ``add_config_arguments``' options name."""
    data: dict[str, Any] = {}
    if args.config:
        try:
            with open(args.config) as handle:
                data = json.load(handle)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read config file {args.config}: {exc}") from exc
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r} must look like KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if key.startswith("postgres."):
            data.setdefault("postgres", {})[key.split(".", 1)[1]] = value
        else:
            data[key] = value
    return apply_environment(from_dict(data)).validate()
