"""Mirror targets: a source table's changes kept as the rows of a target table.

A mirror target holds, for every key, the row of the key's last change in Kafka order:
a create, snapshot read or update writes the row (an upsert), a delete removes it. A
primary-key change arrives from Debezium as a delete of the old key and a create of the
new one; they are changes of two keys, and both apply.

This module holds the target's definition, the per-batch compaction as a reference model
(``compact``: what ``mirror_sql`` computes in the database, over the staged changes), and
the staging lines of a change batch. Changes are staged one line per Kafka record, never
compacted before staging, so that poison isolation (``sink/batch_sink.py``, transition 6)
can still apply a key's good changes and quarantine only the one the database refuses.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from spark_apps.eos_stream.cdc import fast_envelope, transactions
from spark_apps.eos_stream.cdc.envelope import Change, EnvelopeError
from spark_apps.eos_stream.cdc.pg_types import TypeNameError, check_pg_type, event_type
from spark_apps.eos_stream.cdc.transaction_groups import GroupCounter
from spark_apps.eos_stream.cdc.transactions import END
from spark_apps.eos_stream.cdc.values import pg_text
from spark_apps.eos_stream.records.parsing import escape_copy


class MirrorError(ValueError):
    """A mirror definition is wrong; the message says how to fix it."""


MAX_IDENTIFIER_BYTES = 63  # PostgreSQL's NAMEDATALEN - 1
KafkaRecord = tuple[str, int, int, bytes | None, bytes | None]  # topic, partition, offset, key, value


@dataclass(frozen=True)
class MirrorTarget:
    """One source table mirrored into one target table.

    :param source: the source table, ``schema.table`` as Debezium's ``source`` names it.
    :param table: the target table (in the pipeline's target schema).
    :param key: the key columns (the source's primary key; composite allowed), in key order.
    :param columns: every column -> its PostgreSQL type, the key columns included.
    :param feeds_aggregates: stage ``before`` too (``deltas``).
    """

    source: str
    table: str
    key: tuple[str, ...]
    columns: Mapping[str, str]
    feeds_aggregates: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        # PostgreSQL cuts longer names to 63 bytes without an error: two sources whose target names
        # share their first 63 bytes would write into one table.
        too_long = [name for name in (self.table, *self.columns) if len(name.encode()) > MAX_IDENTIFIER_BYTES]
        if too_long:
            raise MirrorError(f"mirror of {self.source!r}: {too_long} longer than PostgreSQL's "
                              f"{MAX_IDENTIFIER_BYTES}-byte names (it would cut them): give the target a shorter "
                              "name (a pattern's target template, e.g. target: {table}, or the table's target)")
        if not self.key:
            raise MirrorError(f"mirror of {self.source!r}: a mirror needs key columns (the source's primary key)")
        missing = [k for k in self.key if k not in self.columns]
        if missing:
            raise MirrorError(f"mirror of {self.source!r}: key columns {missing} are not among its columns")
        try:
            object.__setattr__(self, "columns", {c: check_pg_type(c, t) for c, t in self.columns.items()})
        except TypeNameError as exc:
            raise MirrorError(f"mirror of {self.source!r}: {exc}") from exc

    @property
    def value_columns(self) -> list[str]:
        return [c for c in self.columns if c not in self.key]


Position = tuple[int, int]  # (partition, offset): Kafka order; a key's changes share one partition


@dataclass
class Merged:
    """A key's changes of one batch, compacted: the last op, the row it leaves (columns the
    changes did not carry are absent: the stored value stays), and the columns still unread.

    :param full: the row starts from a full image of this batch (a create, snapshot read or
        delete): the stored row is another row's past and lends it nothing."""

    op: str
    after: dict[str, Any] | None
    unchanged: frozenset[str]
    position: Position
    full: bool = False


def key_of(target: MirrorTarget, change: Change) -> tuple:
    try:
        return tuple(change.key[k] for k in target.key)
    except KeyError as exc:
        raise EnvelopeError(f"{change.table}: the record key lacks key column {exc.args[0]!r}") from exc


def _merge(held: Merged | None, change: Change, position: Position) -> Merged:
    if change.op == "d":
        return Merged("d", None, frozenset(), position, full=True)
    after = dict(change.after or {})
    if held is None or held.op == "d" or change.op in ("c", "r"):
        return Merged(change.op, after, change.unchanged, position, full=change.op != "u" or held is not None)
    # An update: a column it could not read keeps the last value the batch gave it, if any.
    assert held.after is not None
    row = {**held.after, **after}
    return Merged("u", row, frozenset(c for c in change.unchanged if c not in row), position, held.full)


def compact(target: MirrorTarget, changes: Iterable[tuple[Position, Change]]) -> dict[tuple, Merged]:
    """The last change of each key wins, in Kafka order; an update's unreadable columns
    take the last value an earlier change of the same batch gave them."""
    merged: dict[tuple, Merged] = {}
    for position, change in sorted(changes, key=lambda item: item[0]):
        key = key_of(target, change)
        merged[key] = _merge(merged.get(key), change, position)
    return merged


def apply_compacted(rows: dict[tuple, dict[str, Any]], target: MirrorTarget, merged: Mapping[tuple, Merged]) -> list:
    """The reference model of the apply: ``rows`` (key -> stored row) after one batch.
    Returns the keys quarantined: an update leaving a column unread for a key with no row."""
    quarantined = []
    for key, change in merged.items():
        if change.op == "d":
            rows.pop(key, None)
            continue
        assert change.after is not None
        stored = None if change.full else rows.get(key)
        if stored is None and change.op == "u" and change.unchanged:
            quarantined.append(key)
            continue
        base = stored or dict.fromkeys(target.columns)
        rows[key] = {**base, **{c: v for c, v in change.after.items() if c in target.columns}}
    return quarantined


# --- staging ----------------------------------------------------------------

STAGE_COLUMNS = ("_topic", "_partition", "_offset", "_key", "_value", "_error",
                 "_target", "_op", "_keys", "_after", "_unchanged", "_before", "_shape", "_create",
                 "_tx", "_collection")
_BODY_CELLS = len(STAGE_COLUMNS) - 6
_STAGE_TYPES = {"_partition": "integer", "_offset": "bigint", "_key": "bytea", "_value": "bytea"}
_NULL = "\\N"
_ENCODER = msgspec.json.Encoder()


def stage_column_types() -> list[tuple[str, str]]:
    """(name, type) of a mirror batch's stage, in COPY order: text but the coordinates and
    raw bytes. Values are cast in the apply, where the database judges them."""
    return [(c, _STAGE_TYPES.get(c, "text")) for c in STAGE_COLUMNS]


def _row_json(row: Mapping[str, Any]) -> str:
    """A row's values as a JSON object of their PostgreSQL text (a jsonb in the apply).
    jsonb cannot hold a NUL, and no UTF-8 a lone surrogate: refused here, as a record error."""
    # A text or an int is its own text: most values skip pg_text's checks.
    texts = {c: v if v is None or type(v) is str else str(v) if type(v) is int else pg_text(v) for c, v in row.items()}
    try:
        # msgspec writes what json.dumps(ensure_ascii=False) writes, several times faster; it
        # refuses a lone surrogate, which json.dumps writes for the check below to name.
        text = _ENCODER.encode(texts).decode()
    except (msgspec.EncodeError, UnicodeError):
        text = json.dumps(texts, ensure_ascii=False, separators=(",", ":"))
    if "\\u0000" in text:
        raise EnvelopeError("a value contains a NUL character, which PostgreSQL text cannot store")
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise EnvelopeError(f"a value is not valid Unicode: {exc.reason}") from exc
    return text


def _copy_cell(value: str | bytes | None) -> str:
    if value is None:
        return _NULL
    if isinstance(value, bytes):
        return "\\\\x" + value.hex()
    return escape_copy(value)


def shape_cell(target: MirrorTarget, change: Change) -> str | None:
    """NULL when the change carries exactly the target's columns (the common case, at the
    cost of a set comparison); else its columns with their event types and the known
    columns it lacks, for the driver's schema-change plan (``schema_changes.plan_from_shapes``)."""
    if change.after is None:
        return None
    carried = set(change.after) | change.unchanged
    if carried == set(target.columns):
        return None
    schemas = change.row_schema or {}
    return json.dumps({"columns": {c: event_type(schemas.get(c)) for c in sorted(carried - set(target.columns))},
                       "lacking": sorted(set(target.columns) - carried)}, sort_keys=True)


def change_cells(target: MirrorTarget, change: Change, create: str | None = None) -> list[str | None]:
    """The stage cells after the coordinates, raw bytes and error of a decoded change.
    ``create``: for a table a pattern names, what the driver needs to create its target
    (``patterns.create_cell``)."""
    key = dict(zip(target.key, key_of(target, change), strict=True))
    before = _row_json(change.before) if target.feeds_aggregates and change.before is not None else None
    unchanged = json.dumps(sorted(change.unchanged)) if change.unchanged else "[]"
    return [target.table, change.op, _row_json(key), None if change.after is None else _row_json(change.after),
            unchanged, before, shape_cell(target, change), create, change.transaction, change.table]


Resolved = tuple[Change, MirrorTarget, str | None]  # a change, its target, its _create cell


class TargetRefused(Exception):
    """A record whose target cannot be made (``patterns``): not the record's fault but the
    pipeline's, so it is staged with ``create`` (a refusal the driver raises for the batch)."""

    def __init__(self, table: str, create: str) -> None:
        super().__init__(create)
        self.table, self.create = table, create


def staging_lines(route: Callable[[str], MirrorTarget | None], decode: Callable[[bytes | None, bytes | None], Any],
                  records: Iterable[KafkaRecord], keep_raw: bool) -> Iterator[str]:
    """``resolved_staging_lines`` for the tables ``route`` names (by source table)."""

    def resolve(key: bytes | None, value: bytes | None) -> Resolved | None:
        change = decode(key, value)
        if change is None:
            return None
        target = route(change.table)
        if target is None:
            raise EnvelopeError(f"no mirror target for source table {change.table!r}")
        return change, target, None

    return resolved_staging_lines(resolve, records, keep_raw)


# A transaction record's line after its coordinates: a BEGIN's (or a tombstone's) every cell
# NULL; an END's its op, counts and transaction. Written directly: the transaction topic brings
# two records per source transaction, and the generic cells cost more than reading them.
_EMPTY_BODY = "\t" + "\t".join([_NULL] * (_BODY_CELLS + 3)) + "\n"
_END_BODY = "\t".join([_NULL] * 4 + [END, _NULL, "{counts}"] + [_NULL] * (_BODY_CELLS - 6) + ["{tx}", _NULL]) + "\n"


_MAX_END_COUNTS = 4096  # distinct counts remembered: a pipeline's ENDs repeat a few


class _EndCounts:
    """An END's events per table the mirror reads (``mirrored``; none of 0), as the stage's
    ``_after`` cell, made once per distinct counts: a stream's ENDs repeat a few (a transaction
    writes a table or two, a handful of rows). A table the connector captures and the mirror
    does not would never bring its events: the mirror is whole over its own tables."""

    __slots__ = ("known", "mirrored", "texts")

    def __init__(self, mirrored: Callable[[str], bool]) -> None:
        self.mirrored = mirrored
        self.known: dict[tuple, str] = {}
        self.texts: dict[bytes, str | None] = {}  # data_collections' JSON text: its cell, None if unread

    def of_text(self, text: bytes) -> str | None:
        """The cell of an END's ``data_collections`` text (``fast_envelope.transaction_head``),
        read once per distinct text; None when only the whole record's reading can judge it."""
        if text in self.texts:
            return self.texts[text]
        if len(self.texts) >= _MAX_END_COUNTS:
            self.texts.clear()
        counts = fast_envelope.event_counts_of_text(text)
        cell = self.texts[text] = None if counts is None else self(counts)
        return cell

    def __call__(self, counts: Mapping[str, int]) -> str:
        key = tuple(counts.items())
        text = self.known.get(key)
        if text is None:
            if len(self.known) >= _MAX_END_COUNTS:
                self.known.clear()
            text = self.known[key] = transactions.counts_json(
                {table: n for table, n in counts.items() if n and self.mirrored(table)})
        return text


def _transaction_record(value: bytes | None) -> transactions.TransactionRecord | None:
    """A transaction-topic record read (None: a tombstone); one it cannot read raises
    ``EnvelopeError``, and is staged refused."""
    try:
        return transactions.parse_transaction_record(value)
    except ValueError as exc:
        raise EnvelopeError(str(exc)) from exc


def _transaction_line(coordinates: str, value: bytes | None, end_counts: _EndCounts) -> str:
    """The stage line of a transaction-topic record (``transactions``) after its coordinates'
    cells: an END's op, its counts (``_EndCounts``) as ``_after``, and its transaction; a
    BEGIN's or a tombstone's cells empty."""
    record = _transaction_record(value)
    if record is None or record.status != END:
        return coordinates + _EMPTY_BODY
    return coordinates + "\t" + _END_BODY.format(counts=escape_copy(end_counts(record.counts)),
                                                  tx=escape_copy(record.tx))


def _count_transaction_record(counter: GroupCounter, topic: str, partition: int, offset: int, value: bytes | None,
                              end_counts: _EndCounts) -> None:
    """A transaction-topic record counted instead of staged (``transaction_groups``): an END as
    its group, a BEGIN or a tombstone as nothing. A record it cannot read raises ``EnvelopeError``
    and is staged, refused."""
    head = None if value is None else fast_envelope.transaction_head(value)
    if head is not None:  # Debezium's own BEGINs and ENDs, nearly always
        status, tx = head[0], head[1].partition(":")[0]  # transactions.tx_part of a string
        cell = end_counts.of_text(head[2]) if status == END and tx else None
        if cell is not None:
            counter.end(topic, partition, offset, tx, cell)
            return
        if status == "BEGIN" and tx:
            counter.skip()
            return
    read: tuple[str, str, Mapping[str, int]] | None = (
        None if value is None else transactions.fast_transaction_record(value))
    if read is None:  # a tombstone, or a record the reference reading judges
        read = _transaction_record(value)
    if read is None or read[0] != END:
        counter.skip()
        return
    counter.end(topic, partition, offset, read[1], end_counts(read[2]))


def _refused_cells(value: bytes | None, error: str) -> list[str | None]:
    """A refused change's error and body: its transaction and table when its envelope can be
    read, so it still counts toward its transaction's END (``transactions.loose_transaction``)."""
    tx, collection = transactions.loose_transaction(value)
    return [error, *[None] * (_BODY_CELLS - 2), tx, collection]


FlatLine = Callable[[str, int, int, bytes | None, bytes | None], str | None]


def resolved_staging_lines(resolve: Callable[[bytes | None, bytes | None], Resolved | None],
                           records: Iterable[KafkaRecord],
                           keep_raw: bool, transaction_topic: str | None = None,
                           mirrored: Callable[[str], bool] = lambda table: True,
                           flat: FlatLine | None = None, counter: GroupCounter | None = None,
                           aligned: bool = False) -> Iterator[str]:
    """One COPY line per Kafka record: a change's cells, a tombstone's empty line (so the
    stage still counts every record), a refused record's error with its raw bytes, a
    record whose target cannot be made, with the refusal for the driver (``TargetRefused``),
    or a record of ``transaction_topic`` (``_transaction_cells``, counting the tables ``mirrored``).
    ``flat`` (``flat_rows.FlatLines.line``) stages the changes it vouches for, the same line
    in meaning, faster; it is not used when ``keep_raw`` asks for every record's bytes.
    With a ``counter`` (a whole mirror's), every staged record is counted in its group, and
    the transaction topic's records are counted instead of staged (``transaction_groups``);
    ``flat`` then counts the lines it makes. ``aligned``: each record counted instead of staged
    yields an empty line, so that the lines pair with the records one to one."""
    if keep_raw:
        flat = None
    escaped_transaction_topic = None if transaction_topic is None else escape_copy(transaction_topic)
    end_counts = _EndCounts(mirrored)
    for topic, partition, offset, key, value in records:
        cells: list[str | bytes | None]
        try:
            if topic == transaction_topic:
                if counter is not None:
                    _count_transaction_record(counter, topic, partition, offset, value, end_counts)
                    if aligned:
                        yield ""
                    continue
                yield _transaction_line(f"{escaped_transaction_topic}\t{partition}\t{offset}", value, end_counts)
                continue
            if flat is not None:
                line = flat(topic, partition, offset, key, value)
                if line is not None:
                    yield line
                    continue
            resolved = resolve(key, value)
            body = [None] * _BODY_CELLS if resolved is None else change_cells(resolved[1], resolved[0], resolved[2])
            raw = (key, value) if keep_raw else (None, None)
            cells = [topic, str(partition), str(offset), *raw, None, *body]
        except EnvelopeError as exc:
            cells = [topic, str(partition), str(offset), key, value, *_refused_cells(value, str(exc))]
        except TargetRefused as refused:
            cells = [topic, str(partition), str(offset), key, value, None, refused.table,
                     *[None] * (_BODY_CELLS - 4), refused.create, None, None]
        if counter is not None:  # the cells of _error, _op, _tx and _collection
            counter.record(topic, partition, offset, cells[7], cells[5] is not None, cells[14], cells[15])  # type: ignore[arg-type]
        yield "\t".join(map(_copy_cell, cells)) + "\n"
