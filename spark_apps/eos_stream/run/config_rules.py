"""What a pipeline's config may not be: every refusal the app's start makes from the config alone.

One list, :data:`RULES`, and one function, :func:`refusals`. The app calls it at its start
(every engine's ``main``, through :func:`refuse`); the provider calls it when a definition is built
(``PipelineDefinition``), and ``eos validate``, ``eos preflight`` and the DAG factory call it with
the spec loaded (``definition_checks``). So a definition the app would refuse is refused before it
is deployed, with the app's own words. tests/unit/test_config_rules.py proves each rule of the
list is made by ``eos validate``.

What needs Kafka or the database (a missing topic, a missing table, ``max_prepared_transactions``)
is not here: ``eos preflight`` and the driver's claim check that.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from spark_apps.eos_stream.sink.modes import MODES

if TYPE_CHECKING:
    from spark_apps.eos_stream.records.spec import PipelineSpec

PIPELINE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")  # a path component: never '.', '..' or hidden
# What ``trigger`` means to Spark: the Spark app's micro-batches. The continuous engine has none.
TRIGGERS = ("availableNow", "processingTime")
# What runs a stream: the Spark engine under spark-submit, or the continuous engine (engines/continuous.py).
ENGINES = ("spark", "continuous")
# The spelling of ``engine: continuous`` before ``engine`` was its own setting: read as it for one
# release (``config.read_deprecated_trigger``), refused with the fix past that reader (``_trigger``).
DEPRECATED_CONTINUOUS_TRIGGER = "continuous"


class ConfigError(ValueError):
    """The configuration is wrong; the message says what and how to fix it."""


class RuledConfig(Protocol):
    """The fields of the app's ``PipelineConfig`` (run/config.py) the rules read. A protocol, so
    that this module imports nothing of config.py, which applies these rules in ``validate``."""

    pipeline: str
    topics: list[str]
    spec: str | None
    mirror: dict[str, Any] | None
    delivery: str
    engine: str
    trigger: str
    create_targets: bool
    transient_retry_seconds: float


Config = TypeVar("Config", bound=RuledConfig)


class Rule(NamedTuple):
    """One refusal: ``check`` returns why the config is refused, or None. A rule with
    ``needs_spec`` gets the loaded PipelineSpec as its second argument. A rule on one field is
    named after it."""

    name: str
    check: Callable[..., str | None]
    needs_spec: bool = False


def _delivery(config: RuledConfig) -> str | None:
    if config.delivery not in MODES:
        return f"unknown delivery mode {config.delivery!r}; choose one of {', '.join(MODES)}"
    return None


def _trigger(config: RuledConfig) -> str | None:
    if config.trigger == DEPRECATED_CONTINUOUS_TRIGGER:
        return "trigger 'continuous' is now engine 'continuous': set engine: continuous and remove trigger"
    if config.trigger not in TRIGGERS:
        return f"unknown trigger {config.trigger!r}; choose one of {', '.join(TRIGGERS)}"
    return None


def _engine(config: RuledConfig) -> str | None:
    if config.engine not in ENGINES:
        return f"unknown engine {config.engine!r}; choose one of {', '.join(ENGINES)}"
    if config.engine == "continuous" and config.trigger in TRIGGERS and config.trigger != "processingTime":
        # The engine runs until stopped and has no micro-batch: a Spark trigger would say otherwise.
        return (f"engine 'continuous' takes no Spark trigger, and trigger {config.trigger!r} is one: remove "
                "trigger (the continuous engine commits a cycle as records arrive, until stopped), or use "
                "engine 'spark'")
    return None


def _topics(config: RuledConfig) -> str | None:
    topics = list(config.topics or ())
    if not topics or any(not t or t.strip() != t for t in topics) or len(set(topics)) != len(topics):
        return f"topics must be one or more distinct non-empty names without spaces, not {topics!r}"
    return None


def _pipeline_name(config: RuledConfig) -> str | None:
    # The name prefixes staging tables and two-phase transaction ids, so one pipeline's name must
    # never be a prefix-with-separator of another's; it is also a path component.
    if not PIPELINE_NAME.fullmatch(config.pipeline or ""):
        return (f"pipeline name {config.pipeline!r} must be 1-100 letters, digits, '_', '-' or '.', "
                "starting with a letter or digit")
    return None


def _positive(name: str, least: int) -> Callable[[RuledConfig], str | None]:
    def check(config: RuledConfig) -> str | None:
        return None if getattr(config, name) >= least else f"{name} must be at least {least}"
    return check


def _not_negative(name: str) -> Callable[[RuledConfig], str | None]:
    def check(config: RuledConfig) -> str | None:
        return None if getattr(config, name) >= 0 else f"{name} must be 0 or more"
    return check


def _transient_retry(config: RuledConfig) -> str | None:
    if config.transient_retry_seconds < 0:
        return "transient_retry_seconds must be 0 or more (0: no retry in the driver)"
    return None


def aggregates_problem(config: RuledConfig, spec: PipelineSpec) -> str | None:
    from spark_apps.eos_stream.records.spec import AggregateTarget
    from spark_apps.eos_stream.sink.modes import MODES

    mode = MODES[config.delivery]
    if spec.has_aggregates and not mode.allows_aggregates:
        aggregates = [t.table for t in spec.targets if isinstance(t, AggregateTarget)]
        return (f"delivery {mode.name!r} cannot protect aggregate targets {aggregates}: an upsert keyed by "
                "the Kafka record does not stop an increment from being applied twice. Use 'exactly_once'.")
    return None


def mirror_delivery_problem(config: RuledConfig, spec: PipelineSpec | None = None) -> str | None:
    """A mirror needs stored offsets: without them a replay moves a row back in time until the
    key's newer change arrives again (the at-least-once JDBC sinks' defect)."""
    from spark_apps.eos_stream.sink.modes import MODES

    mirror = config.mirror is not None or (spec is not None and spec.mirror is not None)
    mode = MODES.get(config.delivery)
    if mirror and mode is not None and not mode.stores_offsets:
        return (f"delivery {config.delivery!r} cannot keep a mirror equal to its source: without offsets stored "
                "with the rows, a replay applies a key's older change after its newer one. Use 'exactly_once' "
                "(or 'two_phase')")
    return None


def _continuous_reads_listed_topics(config: RuledConfig, spec: PipelineSpec) -> str | None:
    # The continuous engine assigns the listed topics' partitions once, at its start; Spark's
    # source re-reads a pattern's topics at every trigger. Refused rather than silently partial.
    pattern = spec.subscription(list(config.topics)) if config.engine == "continuous" else None
    if pattern is None:
        return None
    return (f"engine 'continuous' reads the pipeline's listed topics only, so it would leave out the tables "
            f"this mirror names by pattern (subscription {pattern!r}), and every one created later. Use engine "
            "'spark' (Spark subscribes by the pattern), or list those tables")


def _spec_or_mirror(config: RuledConfig) -> str | None:
    # What the records hold is told once: by a Python spec, or by a mirror section.
    if config.spec and config.mirror is not None:
        return "a pipeline names either a spec or a mirror section, not both"
    if not config.spec and config.mirror is None:
        return "required: name the spec (package.module:ATTRIBUTE), or give a mirror section (docs/cdc.md)"
    return None


def _whole_transactions_read_their_topic(config: RuledConfig, spec: PipelineSpec) -> str | None:
    # The ENDs order and bound what a batch applies: without them nothing of a transaction would apply.
    topic = spec.transaction_topic()
    if topic is None or topic in config.topics:
        return None
    return (f"a mirror with transactions: whole reads the connector's transaction topic {topic!r} with its change "
            f"topics: add it to topics (and set provide.transaction.metadata=true on the connector), or set "
            "mirror.transactions: per_key")


def _create_targets_needs_ddl(config: RuledConfig, spec: PipelineSpec) -> str | None:
    if config.create_targets and spec.target_ddl is None:
        return f"create_targets is set but spec {spec.name!r} has no target_ddl; create its tables yourself"
    return None


RULES: tuple[Rule, ...] = (
    Rule("pipeline", _pipeline_name),
    Rule("topics", _topics),
    Rule("delivery", _delivery),
    Rule("trigger", _trigger),
    Rule("engine", _engine),
    Rule("max_offsets_per_trigger", _positive("max_offsets_per_trigger", 1)),
    Rule("driver_write_max_records", _not_negative("driver_write_max_records")),
    Rule("continuous_linger_ms", _not_negative("continuous_linger_ms")),
    Rule("continuous_max_bytes", _positive("continuous_max_bytes", 1)),
    Rule("max_batch_attempts", _positive("max_batch_attempts", 1)),
    Rule("transient_retry_seconds", _transient_retry),
    Rule("mirror_needs_stored_offsets", mirror_delivery_problem),
    Rule("spec", _spec_or_mirror),  # and by loading the spec: see refusals()
    Rule("aggregates_need_exactly_once", aggregates_problem, needs_spec=True),
    Rule("create_targets_needs_ddl", _create_targets_needs_ddl, needs_spec=True),
    Rule("continuous_reads_listed_topics", _continuous_reads_listed_topics, needs_spec=True),
    Rule("whole_transactions_read_their_topic", _whole_transactions_read_their_topic, needs_spec=True),
)


class Refusal(NamedTuple):
    rule: str
    message: str


def refusals(config: RuledConfig, *, load_spec: bool = True) -> list[Refusal]:
    """Every rule ``config`` breaks, in :data:`RULES` order.

    :param load_spec: also import the spec and apply the rules that need it (the app's start,
        ``eos validate``); without it (a definition being built, a recovery step reading its
        config) only the rules on the fields apply."""
    from spark_apps.eos_stream.records.spec import SpecError, spec_of

    found = [Refusal(rule.name, problem) for rule in RULES
             if not rule.needs_spec and (problem := rule.check(config))]
    if not load_spec or any(r.rule in ("delivery", "spec") for r in found):
        return found
    try:
        spec = spec_of(config)
    except SpecError as exc:
        return [*found, Refusal("spec", str(exc))]
    except Exception as exc:  # a spec module may fail in any way, not only ImportError
        what = f"cannot import spec module of {config.spec!r}" if config.spec else "cannot read the mirror section"
        return [*found, Refusal("spec", f"{what}: {type(exc).__name__}: {exc}")]
    return found + [Refusal(rule.name, problem) for rule in RULES
                    if rule.needs_spec and (problem := rule.check(config, spec))]


def refuse(config: Config, *, load_spec: bool = True) -> Config:
    """``config``, or :class:`ConfigError` naming every rule it breaks."""
    found = refusals(config, load_spec=load_spec)
    if found:
        raise ConfigError("; ".join(r.message for r in found))
    return config
