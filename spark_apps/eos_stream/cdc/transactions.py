"""Source transactions applied whole (``mirror.transactions: whole``): the pure rules.

With ``provide.transaction.metadata=true``, Debezium writes a BEGIN and an END record per
source transaction to ``<topic.prefix>.transaction``; the END carries the transaction's event
count per table (``data_collections``), and each data event carries its transaction in
``transaction.id``. PostgreSQL's id is ``txId:LSN``, and the LSN part differs between the
BEGIN, the data events and the END of one transaction, so transactions are matched on the
part before ``:`` (:func:`tx_part`).

A batch's **candidates** are the records earlier batches held back plus its own. Walking the
ENDs in the transaction topic's order (one partition: the source's commit order), a
transaction is **applicable** when the per-table counts of its data events among the
candidates equal its END's, and every earlier END was applicable: the walk stops at the first
that is not, so a later transaction is never visible without an earlier one. A record
without a transaction (a snapshot read, a tombstone) is free, but within a partition nothing
is applied after a held record (per-key Kafka order). :func:`plan` is the reference model, one
record at a time, of what ``transactions_sql`` decides in the database from the candidates'
counts per partition, kind, transaction and table.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import msgspec

from spark_apps.eos_stream.cdc import fast_envelope

WHOLE = "whole"
PER_KEY = "per_key"
TRANSACTION_MODES = (PER_KEY, WHOLE)
END = "END"  # the stage's _op of a transaction's END record
TRANSACTION_SUFFIX = "transaction"  # Debezium's topic.transaction default


class TransactionError(RuntimeError):
    """The batch cannot apply whole transactions; the message names the transaction and the fix.
    Not a record's fault: the run fails at once, nothing of the batch applied."""


def transaction_topic(topic_prefix: str) -> str:
    """The connector's transaction topic, ``<topic.prefix>.transaction``."""
    return f"{topic_prefix}.{TRANSACTION_SUFFIX}"


def tx_part(transaction_id: Any) -> str | None:
    """The txId part of Debezium's ``txId:LSN`` transaction id (the whole id if it has no ``:``)."""
    if transaction_id is None:
        return None
    return str(transaction_id).split(":", 1)[0]


def _payload(document: Any) -> Any:
    """The converter's payload, with or without its schema wrapper."""
    if isinstance(document, dict) and set(document) == {"schema", "payload"}:
        return document["payload"]
    return document


class TransactionRecord(NamedTuple):
    """A BEGIN or END of the transaction topic. ``counts``: the END's events per
    ``schema.table`` (``data_collections``); empty for a BEGIN. A named tuple: the topic brings
    two a source transaction, each read where the changes are staged."""

    status: str
    tx: str
    counts: Mapping[str, int] = MappingProxyType({})

    def counts_json(self) -> str:
        return counts_json(self.counts)


def counts_json(counts: Mapping[str, int]) -> str:
    """An END's events per table as the stage's ``_after`` cell: compact JSON, tables sorted
    (msgspec's: the json module's encoder was a third of the transaction topic's staging)."""
    return msgspec.json.encode(counts, order="sorted").decode()


def parse_transaction_record(value: bytes | None) -> TransactionRecord | None:
    """A transaction-topic record's value; None for a tombstone. A well-formed BEGIN or END is
    read by ``fast_envelope``; any other record by ``json`` here, which gives its verdict.

    :raises ValueError: not a BEGIN or END of Debezium's transaction topic (the message says why)."""
    if value is None:
        return None
    read = fast_transaction_record(value)
    if read is None:
        return _parse_with_json(value)
    return TransactionRecord(*read) if read[2] else TransactionRecord(read[0], read[1])


def fast_transaction_record(value: bytes) -> tuple[str, str, Mapping[str, int]] | None:
    """(status, txId, events per table) of a BEGIN or END ``fast_envelope`` vouches for, as
    :func:`parse_transaction_record` reads it; None when that reading must judge the record."""
    read = fast_envelope.transaction_record(value)
    tx = None if read is None else read[1].partition(":")[0]  # tx_part of the string msgspec vouched for
    return (read[0], tx, read[2]) if read is not None and tx else None


def _parse_with_json(value: bytes) -> TransactionRecord:
    """The reference reading of a transaction-topic record (``parse_transaction_record``)."""
    try:
        payload = _payload(json.loads(value))
    except (UnicodeError, ValueError) as exc:
        raise ValueError(f"malformed transaction record JSON: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("status") not in ("BEGIN", END):
        raise ValueError("a transaction-topic record must have status BEGIN or END")
    tx = tx_part(payload.get("id"))
    if not tx:
        raise ValueError("a transaction-topic record must have an id")
    if payload["status"] == "BEGIN":
        return TransactionRecord("BEGIN", tx)
    counts: dict[str, int] = {}
    for entry in payload.get("data_collections") or []:
        entry = entry if isinstance(entry, dict) else {}
        name, count = entry.get("data_collection"), entry.get("event_count")
        if not isinstance(name, str) or not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"transaction {tx}: END has a malformed data_collections entry {entry!r}")
        counts[name] = counts.get(name, 0) + count
    return TransactionRecord(END, tx, counts)


def transaction_of_payload(payload: Mapping[str, Any]) -> str | None:
    """The txId part of a change event's ``transaction`` block; None without one (a snapshot
    read, or a connector without ``provide.transaction.metadata``)."""
    block = payload.get("transaction")
    return tx_part(block.get("id")) if isinstance(block, Mapping) else None


def loose_transaction(value: bytes | None) -> tuple[str | None, str | None]:
    """(txId, ``schema.table``) of a change record refused for its values, when its envelope
    can still be read: a refused record still counts toward its transaction's END (it is
    dead-lettered when the transaction applies). (None, None) when nothing can be read."""
    try:
        payload = _payload(json.loads(value)) if value is not None else None
    except (UnicodeError, ValueError, RecursionError):
        return None, None
    if not isinstance(payload, dict):
        return None, None
    source = payload.get("source")
    collection = None
    if isinstance(source, dict) and isinstance(source.get("table"), str):
        schema = source.get("schema")
        collection = f"{schema}.{source['table']}" if isinstance(schema, str) else source["table"]
    return transaction_of_payload(payload), collection


# --- the reference model ------------------------------------------------------

Coordinate = tuple[str, int, int]  # (topic, partition, offset)


@dataclass(frozen=True)
class Candidate:
    """One staged or held record as the walk sees it.

    :param kind: ``END`` for a transaction's END; ``change`` for a data event (refused ones
        included); ``free`` for a record of no transaction (snapshot read, tombstone, BEGIN).
    :param tx: the transaction of an END or a data event.
    :param collection: a data event's ``schema.table``.
    :param counts: an END's events per ``schema.table``."""

    coordinate: Coordinate
    kind: str
    tx: str | None = None
    collection: str | None = None
    counts: Mapping[str, int] = field(default_factory=dict)


@dataclass
class Plan:
    """What a batch applies and what it holds back."""

    applicable: list[str]  # transactions, in commit order
    held: set[Coordinate]
    waiting: list[str]  # ENDs seen but not applicable, in commit order

    def applied(self, candidates: Iterable[Candidate]) -> list[Coordinate]:
        return sorted(c.coordinate for c in candidates if c.coordinate not in self.held)


def _seen_counts(candidates: Iterable[Candidate]) -> dict[str, dict[str, int]]:
    seen: dict[str, dict[str, int]] = {}
    for c in candidates:
        if c.kind == "change" and c.tx is not None:
            per_table = seen.setdefault(c.tx, {})
            per_table[str(c.collection)] = per_table.get(str(c.collection), 0) + 1
    return seen


def _check(end: Candidate, seen: Mapping[str, int]) -> bool:
    """Whether END's transaction is complete; raises when more events arrived than it counts."""
    extra = sorted(t for t, n in seen.items() if n > end.counts.get(t, 0))
    if extra:
        raise TransactionError(impossible_message(end.tx, extra))
    return dict(seen) == {t: n for t, n in end.counts.items() if n}


def impossible_message(tx: Any, tables: Any) -> str:
    return (f"source transaction {tx}: more change events of {tables} than its END counts: the change topics "
            "hold events the transaction topic does not describe (an SMT that adds or reroutes records, or "
            "two connectors writing one topic prefix); applying it whole is impossible. Fix the connector, "
            "or set mirror.transactions: per_key")


def plan(candidates: list[Candidate]) -> Plan:
    """The walk (see the module): the applicable transactions and the held coordinates."""
    seen = _seen_counts(candidates)
    applicable: list[str] = []
    waiting: list[str] = []
    held: set[Coordinate] = set()
    for end in sorted((c for c in candidates if c.kind == END), key=lambda c: c.coordinate):
        assert end.tx is not None
        if not waiting and _check(end, seen.get(end.tx, {})):
            applicable.append(end.tx)
        else:
            _check(end, seen.get(end.tx, {}))
            waiting.append(end.tx)
            held.add(end.coordinate)
    ready = set(applicable)
    by_tx = {c.coordinate for c in candidates if c.kind == "change" and c.tx is not None and c.tx not in ready}
    first_held: dict[tuple[str, int], int] = {}
    for topic, partition, offset in by_tx:
        first_held[(topic, partition)] = min(offset, first_held.get((topic, partition), offset))
    for c in candidates:
        topic, partition, offset = c.coordinate
        if c.coordinate in by_tx or offset > first_held.get((topic, partition), offset):
            if c.kind == "change" and c.tx in ready:
                first = (topic, partition, first_held[(topic, partition)])
                earlier = next(b.tx for b in candidates if b.coordinate == first)
                raise TransactionError(misordered_message(c.tx, c.coordinate, earlier))
            held.add(c.coordinate)
    return Plan(applicable, held, waiting)


def misordered_message(tx: Any, coordinate: Any, earlier: Any) -> str:
    return (f"source transaction {tx} is complete, but its event at {coordinate} follows an event of transaction "
            f"{earlier}, whose END has not come: in the source's commit order it would have. Either that END is "
            "lost (the transaction topic lost records to retention, or was recreated), or the change topics are "
            "not in commit order (partitions added while the mirror was behind). Transaction "
            f"{earlier} can never apply whole: re-snapshot into a new pipeline, or set mirror.transactions: per_key")


# --- the kinds the walk in SQL counts (``transactions_sql``) -------------------

# Besides END; UNTRACKED: a streaming change without a transaction.
CHANGE, FREE, UNTRACKED = "change", "free", "untracked"


def untracked_message(coordinate: Any) -> str:
    topic, partition, offset = coordinate
    return (f"the change at {topic}[{partition}]@{offset} carries no transaction: a mirror with transactions: "
            "whole needs the connector's provide.transaction.metadata=true (postgres_connector_config sets it); "
            "set it and restart the connector, or set mirror.transactions: per_key")
