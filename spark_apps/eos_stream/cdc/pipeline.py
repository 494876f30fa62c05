"""A mirror pipeline's spec: the change stream's mirror plugged into the sink's staged path.

``mirror_spec`` builds the :class:`PipelineSpec` of a config's ``mirror`` section
(``records.spec.spec_of``, once per process). No Python is needed.

The sink knows no mirror: it calls :class:`MirrorBatches` through ``PipelineSpec.mirror``.
On the executors, each Kafka record becomes one stage line (``mirror.staging_lines``); in the
batch's transaction, the driver makes the batch's schema changes, runs the mirror's apply
statement (``mirror_sql``: stored offsets, one copy per coordinate, an isolated range, as the
row pipeline's) and removes the aggregate groups left empty. The offsets are stored by the
sink in that same transaction, so a batch applies whole, with its offsets, or not at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from psycopg2 import sql

from spark_apps.eos_stream.cdc import (
    aggregate_sql,
    flat_rows,
    mirror,
    mirror_sql,
    patterns,
    schema_changes,
    transaction_groups,
    transactions,
    transactions_sql,
)
from spark_apps.eos_stream.cdc.definition import MirrorDefinition, parse_mirror
from spark_apps.eos_stream.cdc.mirror import MirrorError, MirrorTarget
from spark_apps.eos_stream.events import emit
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.kafka.ranges import MessageChunk
from spark_apps.eos_stream.records import batch_lines
from spark_apps.eos_stream.records.columns import Columns
from spark_apps.eos_stream.records.spec import BatchRun, PipelineSpec, SpecError, read_mirror_section
from spark_apps.eos_stream.state.ddl import run_ddl

# The COPY text a batch's stage lines are sent in, at most this many characters and one line
# more: the text of a batch of large records (a stage line holds the record's columns as JSON)
# is never held whole beside the records it is made of.
STAGE_CHUNK_CHARS = 8 << 20


def bounded_chunks(lines: Iterable[str], limit: int, made: list[str] | None = None) -> Iterator[bytes]:
    """``lines`` as UTF-8 chunks of whole lines, each of fewer than ``limit`` characters but
    its last line; one empty chunk when there is no line (a batch's chunk, as before).
    ``made``: gets every line, once its chunk is sent."""
    chunk: list[str] = []
    size, sent = 0, False
    for line in lines:
        chunk.append(line)
        size += len(line)
        if size >= limit:
            yield "".join(chunk).encode()
            if made is not None:
                made += chunk
            chunk, size, sent = [], 0, True
    if chunk or not sent:
        yield "".join(chunk).encode()
        if made is not None:
            made += chunk


def _records(batch: Any) -> Iterable[tuple[str, int, int, bytes | None, bytes | None]]:
    """(topic, partition, offset, key, value) of a chunk of Kafka messages or of an Arrow batch."""
    return batch.records() if isinstance(batch, MessageChunk) else batch_lines.arrow_records(batch)


def mirror_spec(section: Mapping[str, Any] | str) -> PipelineSpec:
    """The spec of a mirror pipeline from its ``mirror`` section (a Python spec module may build
    one too), or from a file or inline JSON holding it (``records.spec.read_mirror_section``)."""
    try:
        definition = parse_mirror(read_mirror_section(section) if isinstance(section, str) else section)
    except MirrorError as exc:
        raise SpecError(f"mirror definition: {exc}") from exc
    batches = MirrorBatches(definition)
    return PipelineSpec(name=f"mirror:{definition.topic_prefix}", fields=(), targets=(),
                        target_ddl=batches.target_ddl, mirror=batches)


class MirrorBatches:
    """``records.spec.MirrorApply`` for one mirror definition: plain values (the executors build
    their own from the section, ``records.spec.SpecSource``)."""

    def __init__(self, definition: MirrorDefinition) -> None:
        self.definition = definition
        self._flat_plans: dict[tuple[str, int, int], Any] = {}  # the fast path's plans, for every stager here

    def stage_column_types(self) -> list[tuple[str, str]]:
        return mirror.stage_column_types()

    def subscription(self, topics: list[str]) -> str | None:
        """The Kafka subscription regex when the definition names tables by pattern, else None."""
        return self.definition.subscription(topics)

    def transaction_topic(self) -> str | None:
        """The connector's transaction topic when the definition applies transactions whole."""
        return self.definition.transaction_topic()

    def target_tables(self) -> list[str]:
        return [t.table for t in self.definition.tables.values()] + [a.table for a in self.definition.aggregates]

    def target_ddl(self, target_schema: str, _unique_coordinates: bool) -> list:
        tables = self.definition.tables
        schema = sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(target_schema))
        return ([schema] + [mirror_sql.target_ddl(t, target_schema) for t in tables.values()]
                + [aggregate_sql.aggregate_ddl(a, tables[a.source], target_schema) for a in self.definition.aggregates])

    def staging_chunks(self, batches: Iterable[Any], keep_raw: bool,
                       counter: transaction_groups.GroupCounter | None = None) -> Iterator[bytes]:
        """The COPY text of a task's Arrow batches or message chunks (``kafka.ranges.MessageChunk``):
        one line per Kafka record, in chunks of
        about ``STAGE_CHUNK_CHARS`` (``bounded_chunks``). With a ``counter`` (``group_counter``),
        the records' transaction groups are counted, and the transaction topic's counted instead of staged."""
        lines = self.lines_of(counter)
        for batch in batches:
            yield from bounded_chunks(lines(_records(batch), keep_raw), STAGE_CHUNK_CHARS)

    def lines_of(self, counter: transaction_groups.GroupCounter | None = None, aligned: bool = False
                 ) -> Callable[[Iterable[mirror.KafkaRecord], bool], Iterator[str]]:
        """What makes the stage lines of (topic, partition, offset, key, value) records, one per
        record but the transaction topic's that ``counter`` counts instead (``staging_chunks``);
        ``aligned``: an empty line for each of those, so that the lines pair with the records."""
        resolve = patterns.Router(self.definition).resolve
        flat = flat_rows.FlatLines(self.definition, counter, self._flat_plans).line
        topic = transactions.transaction_topic(self.definition.topic_prefix)

        def lines(records: Iterable[mirror.KafkaRecord], keep_raw: bool) -> Iterator[str]:
            return mirror.resolved_staging_lines(resolve, records, keep_raw, topic, self.definition.mirrors, flat,
                                                 counter, aligned)

        return lines

    def group_counter(self) -> transaction_groups.GroupCounter | None:
        """A counter of transaction groups for a mirror of whole transactions (None for ``per_key``)."""
        return transaction_groups.GroupCounter() if self.definition.whole_transactions else None

    def staging_weights(self) -> dict[str, float]:
        """The transaction topic's records, counted and not staged, as a share of a change's work."""
        topic = self.definition.transaction_topic()
        return {} if topic is None else {topic: transaction_groups.TRANSACTION_RECORD_WEIGHT}

    def batch_run(self, cur: Any, stage: Any, *, target_schema: str, meta_schema: str,
                  skip_applied: bool, pipeline: str = "", staged_once: bool = False,
                  groups: Columns | None = None, walked: bool = False,
                  starts: Mapping[TopicPartition, int] | None = None) -> BatchRun:
        """Makes the batch's schema changes on ``cur`` (its transaction), then returns the
        apply of the stage (or of one isolated range of it) to the targets they leave. A mirror
        of whole transactions first rewrites the stage to the records it applies now
        (``transactions_sql``); the stage then holds records below the stored offsets, which
        the apply must not skip, and it dedupes only when a retried task staged copies (the
        writer's count of the stage no longer tells). ``staged_once``: the writer's count of the
        stage, before the walk, found no copies, so the walk need not look for them. ``groups``:
        the stagers' count of the stage's transaction groups (``StageCount.groups``). ``walked``: the
        stager decided the transactions (``engines/cycle_hold``): the stage is what applies now,
        but for records below the stored offsets, skipped as in any batch. ``starts``: where the
        batch's ranges start (None: not known), which tells whether it may hold records below them."""
        whole, copies, released = self.definition.whole_transactions, 0, 0
        moved = whole and not walked  # the stage may hold records below the stored offsets now
        if moved:
            done = transactions_sql.hold_and_release(cur, stage, meta_schema, pipeline, skip_applied,
                                                     str(self.definition.transaction_topic()), staged_once,
                                                     groups, starts)
            copies = done.pop("copies")
            if done["held"] or done["released"]:
                emit("mirror_transactions", **done)
        elif not whole:  # a mirror that ran whole until now applies what it held, per key
            released = transactions_sql.release_all(cur, stage, meta_schema, pipeline, skip_applied)
            if released:
                emit("mirror_transactions", released=released, held=0, mode="per_key")
        targets = self._targets_for_batch(cur, stage, target_schema)
        if self.definition.patterns:
            targets += patterns.batch_targets(cur, stage, target_schema, [t.table for t in targets])
        aggregates = self.definition.aggregates

        def run(cur: Any, dedupe: bool, only_range: bool, params: dict) -> tuple[int, int]:
            cur.execute(mirror_sql.apply_mirror_statement(
                targets, stage=stage, target_schema=target_schema, meta_schema=meta_schema,
                skip_applied=skip_applied and not (moved or released), dedupe=copies > 0 if whole else dedupe,
                only_range=only_range,
                aggregates=aggregates), params)
            row = cur.fetchone()
            assert row is not None
            for aggregate in aggregates:
                cur.execute(aggregate_sql.prune_empty_groups(aggregate, target_schema))
            return int(row[0]), int(row[1])

        return run

    def _targets_for_batch(self, cur: Any, stage: Any, target_schema: str) -> list[MirrorTarget]:
        """The targets as this batch must write them: the definition's, with the columns the
        target tables gained since (added by an earlier batch) and the ones this batch adds.
        A refused change (``SchemaChangeRefused``) fails the batch at once: no record is at fault."""
        cur.execute(sql.SQL("SELECT DISTINCT _target, _shape FROM {} WHERE _shape IS NOT NULL").format(stage))
        shapes: dict[str, list[str]] = {}
        for table, shape in cur.fetchall():
            shapes.setdefault(table, []).append(shape)
        targets = list(self.definition.tables.values())
        if not shapes:
            return targets  # every change carries exactly the definition's columns
        stored = schema_changes.stored_columns(cur, target_schema, list(shapes))
        planned = []
        for target in targets:
            if target.table in shapes:
                target = dataclasses.replace(target, columns={**stored.get(target.table, {}), **target.columns})
                plan = schema_changes.plan_from_shapes(target, target_schema, shapes[target.table])
                if plan.add:
                    run_ddl(cur, plan.add)
                    target = dataclasses.replace(target, columns={**target.columns, **plan.new_columns})
                    emit("mirror_columns_added", table=target.table, columns=plan.new_columns)
                if plan.dropped:
                    emit("mirror_columns_kept", table=target.table, columns=plan.dropped,
                         why="changes of the source table no longer carry them; the mirror keeps what it holds")
            planned.append(target)
        return planned
