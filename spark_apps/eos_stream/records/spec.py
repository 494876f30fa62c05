"""What a pipeline writes: the record fields it expects and the targets it feeds.

A pipeline is pluggable: a user module defines a :class:`PipelineSpec` (fields,
targets, an optional per-record transform, and the DDL of its targets) and
names it in the app's config as ``module:attribute``. The other packages under
``spark_apps/`` are the shipped examples; this module names none of them.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from spark_apps.eos_stream.records.columns import Columns

# PostgreSQL types the record parser knows how to validate and encode for COPY.
SUPPORTED_TYPES = ("text", "bigint", "integer", "numeric", "double precision", "boolean", "timestamptz")

# Field types an aggregate may sum: exact ones. A sum of floats depends on the
# order of the additions, which neither PostgreSQL nor Spark fixes, so no two
# runs (and no audit) could be held to the same total; use numeric instead.
SUMMABLE_TYPES = ("bigint", "integer", "numeric")

# Target columns that carry each row's Kafka coordinates.
SOURCE_COLUMNS = ("kafka_topic", "kafka_partition", "kafka_offset")


class SpecError(ValueError):
    """A pipeline spec or its use is wrong; the message says how to fix it."""


@dataclass(frozen=True)
class Field:
    """One field of the JSON record value.

    :param name: JSON key, also the column name in staging and targets.
    :param pg_type: one of SUPPORTED_TYPES.
    :param required: a record without it is dead-lettered.
    """

    name: str
    pg_type: str
    required: bool = True

    def __post_init__(self) -> None:
        if self.pg_type not in SUPPORTED_TYPES:
            raise SpecError(f"field {self.name!r}: type {self.pg_type!r} is not one of {SUPPORTED_TYPES}")
        if self.name.startswith("_"):
            raise SpecError(f"field {self.name!r}: names starting with '_' are reserved for staging")


@dataclass(frozen=True)
class RowTarget:
    """One row per record, with its Kafka coordinates in SOURCE_COLUMNS.

    :param table: target table name (in the pipeline's target schema).
    :param columns: record fields copied into same-named columns.
    """

    table: str
    columns: tuple[str, ...]

    aggregate = False


@dataclass(frozen=True)
class AggregateTarget:
    """Per-key running totals: ``column += value`` for every record of the key,
    and optionally the key's latest values.

    Not idempotent: applying a record twice shows in the sums, which is why it
    only takes exactly-once delivery (or the at-least-once baseline).

    :param table: target table; needs a unique constraint on ``group_by``.
    :param group_by: record fields that form the key.
    :param increments: target column -> record field to add, or None to add 1.
    :param latest: target column -> record field whose value from the key's last
        record in Kafka order it holds (the highest offset; ties across partitions
        go to the highest partition). Order is Kafka's per partition, so this is
        the key's latest value only when all of a key's records share one
        partition, as they do on a topic keyed by ``group_by`` (docs/ordering.md).
    """

    table: str
    group_by: tuple[str, ...]
    increments: Mapping[str, str | None]
    latest: Mapping[str, str] = field(default_factory=dict)

    aggregate = True

    @property
    def columns(self) -> list[str]:
        """Every column the aggregate writes besides its key: increments, then latest."""
        return [*self.increments, *self.latest]

    @property
    def inputs(self) -> set[str]:
        """The record fields the aggregate reads."""
        return set(self.group_by) | {v for v in self.increments.values() if v} | set(self.latest.values())


Target = RowTarget | AggregateTarget

# A run's apply of one staged batch: run(cur, dedupe, only_range, params) -> (applied, dead-lettered).
BatchRun = Callable[[Any, bool, bool, dict], tuple[int, int]]


class StageCount(NamedTuple):
    """What a stager reports of the records it staged: how many lines (``rows``; None: unknown),
    and, for a mirror of whole transactions, their transaction groups
    (``cdc/transaction_groups.py``; None: not counted, so the apply counts the stage), or
    ``walked``: the stager decided the transactions itself (``engines/cycle_hold``), so the stage
    holds exactly the records to apply now."""

    rows: int | None
    groups: Columns | None = None
    walked: bool = False  # the stager walked the transactions: the stage holds what applies now

    @classmethod
    def of(cls, reported: StageCount | int | None) -> StageCount:
        """A stager's report as a StageCount (a row pipeline's stagers report only a count)."""
        return reported if isinstance(reported, StageCount) else cls(reported)

    @classmethod
    def merged(cls, reports: Iterable[StageCount | int | None]) -> StageCount:
        """The reports of a batch's tasks as one: their rows summed (unknown if one is), their groups joined."""
        counts = [cls.of(r) for r in reports]
        rows = None if any(c.rows is None for c in counts) else sum(c.rows or 0 for c in counts)
        parts = [c.groups for c in counts if c.groups is not None]
        groups = Columns.joined(parts) if len(parts) == len(counts) else None
        return cls(rows, groups, walked=bool(counts) and all(c.walked for c in counts))


class MirrorApply(Protocol):
    """How a change stream's mirror (``cdc/``) is staged and applied, for the sink, which knows
    no mirror: the executors stage each Kafka record as one line of ``stage_column_types``,
    and the batch's transaction runs what ``batch_run`` returns, on the stage, as the row
    pipeline runs its apply statement (isolation included: ``only_range``)."""

    def stage_column_types(self) -> list[tuple[str, str]]: ...

    def staging_chunks(self, batches: Iterable[Any], keep_raw: bool, counter: Any = None) -> Iterator[bytes]:
        """``counter``: ``group_counter()``'s, which counts what the lines stage."""
        ...

    def lines_of(self, counter: Any = None, aligned: bool = False) -> Callable[[Iterable[Any], bool], Iterator[str]]:
        """What makes the stage lines of (topic, partition, offset, key, value) records, one per
        record but those ``counter`` counts instead of staging (an empty one each if ``aligned``)."""
        ...

    def group_counter(self) -> Any:
        """A counter of the staged records' transaction groups, for a mirror of whole transactions; else None."""
        ...

    def staging_weights(self) -> dict[str, float]:
        """A record's staging work per topic where it differs from a change's 1 (``kafka.ranges.balanced_shares``)."""
        ...

    def target_tables(self) -> list[str]: ...

    def subscription(self, topics: list[str]) -> str | None:
        """A regex over topic names when the mirror reads every topic it matches, ``topics``
        and topics created later included (Spark's ``subscribePattern``); None: ``topics``."""
        ...

    def batch_run(self, cur: Any, stage: Any, *, target_schema: str, meta_schema: str,
                  skip_applied: bool, pipeline: str = "", staged_once: bool = False,
                  groups: Columns | None = None, walked: bool = False,
                  starts: Mapping[tuple[str, int], int] | None = None) -> BatchRun:
        """``staged_once``: the stage is known to hold each record once (no retried task's copies);
        ``groups``: the stagers' transaction groups (``StageCount.groups``); ``walked``: the stage
        holds exactly the records to apply (``StageCount.walked``); ``starts``: where the batch's
        ranges start, per (topic, partition) (None: not known)."""
        ...

    def transaction_topic(self) -> str | None:
        """The connector's transaction topic when the mirror applies source transactions whole."""
        ...


@dataclass(frozen=True)
class PipelineSpec:
    """Everything the sink needs to know about a pipeline's data.

    :param name: a label for logs.
    :param fields: the record's fields, validated per record on the executors.
    :param targets: tables fed in one transaction per micro-batch.
    :param transform: optional per-record function (dict -> dict) run after
        validation; an exception from it dead-letters that record.
    :param target_ddl: optional function(schema, unique_coordinates) -> list of
        statements (``psycopg2.sql`` objects, or ``ddl.AddColumn`` for columns
        added later) that creates the targets; used only when the app is asked
        to create them.
    :param mirror: a change stream's mirror instead of ``fields`` and ``targets``
        (``MirrorApply``; a config's ``mirror`` section builds one, see ``spec_of``).
    """

    name: str
    fields: tuple[Field, ...]
    targets: tuple[Target, ...]
    transform: Callable[[dict], dict] | None = None
    target_ddl: Callable[[str, bool], list] | None = field(default=None, compare=False)
    mirror: MirrorApply | None = field(default=None, compare=False)

    def subscription(self, topics: list[str]) -> str | None:
        """The topic regex a pipeline reading ``topics`` subscribes to, or None (``topics`` alone)."""
        return None if self.mirror is None else self.mirror.subscription(topics)

    def transaction_topic(self) -> str | None:
        """The topic of a mirror's source-transaction records, read with its change topics, or None."""
        return None if self.mirror is None else self.mirror.transaction_topic()

    def __post_init__(self) -> None:
        names = {f.name for f in self.fields}
        for target in self.targets:
            used = target.inputs if isinstance(target, AggregateTarget) else set(target.columns)
            if isinstance(target, AggregateTarget) and set(target.increments) & set(target.latest):
                raise SpecError(f"target {target.table!r}: a column is either an increment or a latest value")
            unknown = used - names
            if unknown:
                raise SpecError(f"target {target.table!r} uses unknown fields {sorted(unknown)}")
            if isinstance(target, AggregateTarget):
                types = {f.name: f.pg_type for f in self.fields}
                inexact = sorted(s for s in target.increments.values() if s and types[s] not in SUMMABLE_TYPES)
                if inexact:
                    raise SpecError(
                        f"target {target.table!r} sums {inexact}, which are not of an exact type "
                        f"{SUMMABLE_TYPES}: a float sum depends on the order of its additions, so it could "
                        "never be checked; declare the field numeric")

    @property
    def has_aggregates(self) -> bool:
        return any(t.aggregate for t in self.targets)

    def target_tables(self) -> list[str]:
        """Every table the pipeline writes in its target schema: its targets', or a mirror's
        tables and aggregates (what a snapshot takes, a restore puts back, preflight checks)."""
        return [t.table for t in self.targets] + (self.mirror.target_tables() if self.mirror is not None else [])


# Where a mirror's spec is built (``cdc.pipeline``), named like a spec so that this package
# imports no change-stream code.
MIRROR_SPEC_FACTORY = "spark_apps.eos_stream.cdc.pipeline:mirror_spec"


@dataclass(frozen=True)
class SpecSource:
    """Where a pipeline's spec comes from, as plain values a Spark task's closure pickles: the
    ``module:ATTRIBUTE`` of a Python spec, or a mirror section as JSON. :meth:`load` builds a
    mirror's spec once per process (each executor's Python worker parses its section once).

    :param reference: a Python spec's ``module:ATTRIBUTE``; None for a mirror.
    :param mirror_json: the config's ``mirror`` section as JSON (its keys in their order); None for a Python spec.
    """

    reference: str | None = None
    mirror_json: str | None = None

    @classmethod
    def of(cls, pipeline: Any) -> SpecSource:
        """The source of a pipeline's spec: ``pipeline`` is an app config or a definition (its
        ``spec`` and ``mirror``)."""
        mirror = getattr(pipeline, "mirror", None)
        if mirror is not None:
            # Keys in the section's own order: a table's columns are created in the order it gives.
            return cls(mirror_json=json.dumps(mirror, default=str))
        return cls(reference=pipeline.spec)

    def load(self) -> PipelineSpec:
        if self.mirror_json is not None:
            return _mirror_spec(self.mirror_json)
        if not self.reference:
            raise SpecError("the pipeline names no spec: name one (package.module:ATTRIBUTE), or give a mirror section")
        return load_spec(self.reference)


@functools.lru_cache(maxsize=8)
def _mirror_spec(mirror_json: str) -> PipelineSpec:
    """A mirror section's spec, built once per process and section (the spec holds plain values)."""
    factory_module, _, factory_name = MIRROR_SPEC_FACTORY.partition(":")
    return getattr(importlib.import_module(factory_module), factory_name)(json.loads(mirror_json))


def read_mirror_section(argument: str) -> Mapping[str, Any]:
    """The ``mirror`` section a reference of the earlier shape (``mirror:<argument>``) names:
    inline JSON (``{...}``), or a YAML or JSON file holding the section, or a pipeline definition
    with a ``mirror`` key. Read for one release, when a config or a definition is built.

    :raises SpecError: the file cannot be read, or holds no mapping."""
    text = argument.strip()
    if not text.startswith("{"):
        try:
            with open(text) as handle:
                text = handle.read()
        except OSError as exc:
            raise SpecError(f"cannot read the mirror definition {argument!r}: {exc}") from exc
    try:
        import yaml  # JSON is YAML too

        # libyaml's loader where built: a large definition loads faster.
        document = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except ImportError:
        document = json.loads(text)
    except Exception as exc:
        raise SpecError(f"the mirror definition {argument[:200]!r} is not valid YAML or JSON: {exc}") from exc
    if isinstance(document, Mapping) and isinstance(document.get("mirror"), Mapping):
        document = document["mirror"]
    if not isinstance(document, Mapping):
        raise SpecError(f"the mirror definition {argument[:200]!r} must be a mapping (the mirror section)")
    return document


def spec_of(pipeline: Any) -> PipelineSpec:
    """The spec of ``pipeline`` (an app config or a definition): its mirror section's, built once
    per process, or the Python spec its ``spec`` names."""
    return SpecSource.of(pipeline).load()


def load_spec(reference: str) -> PipelineSpec:
    """Imports ``package.module:ATTRIBUTE`` and checks it is a PipelineSpec (a mirror's spec comes
    from its section: :func:`spec_of`)."""
    if reference.startswith("mirror:"):
        raise SpecError(f"spec {reference[:80]!r} is no Python spec: a mirror pipeline gives its section as the "
                        "config's mirror field (docs/cdc.md)")
    module_name, _, attribute = reference.partition(":")
    if not attribute:
        raise SpecError(f"spec {reference!r} must look like 'package.module:ATTRIBUTE'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"cannot import spec module {module_name!r}: {exc}") from exc
    spec = getattr(module, attribute, None)
    if not isinstance(spec, PipelineSpec):
        found = "it has no such attribute" if spec is None else f"it is a {type(spec).__name__}"
        present = sorted(name for name, value in vars(module).items() if isinstance(value, PipelineSpec))
        raise SpecError(f"{reference!r} is not a PipelineSpec ({found}); module {module_name!r} defines "
                        + (f"the PipelineSpecs {', '.join(present)}" if present else "no PipelineSpec"))
    return spec
