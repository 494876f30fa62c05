"""Whole source transactions: reading Debezium's transaction records, and the walk that decides
what a batch applies (``cdc/transactions.py``), as the SQL must compute it."""

from __future__ import annotations

import json

import pytest

from spark_apps.eos_stream.cdc import mirror, transactions
from spark_apps.eos_stream.cdc.definition import parse_mirror
from spark_apps.eos_stream.cdc.envelope import parse_envelope
from spark_apps.eos_stream.cdc.mirror import MirrorError
from spark_apps.eos_stream.cdc.patterns import Router
from spark_apps.eos_stream.cdc.transactions import END, Candidate, TransactionError, plan

TX = "app.transaction"
DATA = "app.public.accounts"


def _end(tx: str, counts: dict[str, int], lsn: int = 99, schemas: bool = False) -> bytes:
    payload = {"status": "END", "id": f"{tx}:{lsn}", "event_count": sum(counts.values()),
               "data_collections": [{"data_collection": t, "event_count": n} for t, n in counts.items()],
               "ts_ms": 1}
    if schemas:
        return json.dumps({"schema": {"type": "struct", "fields": []}, "payload": payload}).encode()
    return json.dumps(payload).encode()


def test_an_end_is_read_with_and_without_schemas_and_matched_on_its_txid() -> None:
    for schemas in (False, True):
        record = transactions.parse_transaction_record(_end("571", {"public.a": 2, "public.b": 1}, schemas=schemas))
        assert record == transactions.TransactionRecord(END, "571", {"public.a": 2, "public.b": 1})
        assert record.counts_json() == '{"public.a":2,"public.b":1}'
    begin = json.dumps({"status": "BEGIN", "id": "571:1000", "event_count": None, "data_collections": None})
    assert transactions.parse_transaction_record(begin.encode()) == transactions.TransactionRecord("BEGIN", "571")
    assert transactions.parse_transaction_record(None) is None
    assert transactions.tx_part("571:23453") == "571" and transactions.tx_part(None) is None


@pytest.mark.parametrize("value, why", [
    (b"{", "malformed"), (b'{"status": "COMMIT", "id": "1:2"}', "BEGIN or END"),
    (b'{"status": "END"}', "must have an id"),
    (b'{"status": "END", "id": "1:2", "data_collections": [{"data_collection": "a", "event_count": -1}]}',
     "malformed data_collections"),
])
def test_a_record_that_is_no_begin_or_end_is_refused_saying_why(value: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        transactions.parse_transaction_record(value)


def _wrapped(payload: dict) -> bytes:
    return json.dumps({"schema": {"type": "struct", "fields": []}, "payload": payload}).encode()


_FAST_CASES = [
    _end("571", {"public.a": 2, "public.b": 1}), _end("571", {"public.a": 2}, schemas=True),
    _wrapped({"status": "BEGIN", "id": "9:1", "event_count": None, "data_collections": None}),
    b'{"status": "END", "id": "9:1", "data_collections": [{"data_collection": "a", "event_count": 1},'
    b' {"data_collection": "a", "event_count": 2}]}',  # one table twice: summed
    b'{"status": "END", "id": 12, "data_collections": []}',  # a numeric id: the reference reads it
    b'{"status": "END", "id": "1:2", "data_collections": [{"data_collection": "a", "event_count": true}]}',
    b'{"status": "END", "id": "1:2", "data_collections": [{"data_collection": "a", "event_count": -1}]}',
    b'{"status": "BEGIN", "id": ":2"}', b'{"status": "COMMIT", "id": "1:2"}', b'{"schema": {}, "payload": 3}',
    b'{"schema": {}, "payload": {"status": "END", "id": "1:2"}, "extra": 1}', b"{", b"[]", b"null",
]


def _transaction_outcome(value: bytes, read: object) -> object:
    try:
        return read(value)  # type: ignore[operator]
    except ValueError as exc:
        return ("refused", str(exc))


@pytest.mark.parametrize("value", _FAST_CASES)
def test_the_fast_reader_of_a_transaction_record_agrees_with_the_reference(value: bytes) -> None:
    """``parse_transaction_record`` (``fast_envelope`` first) gives the same record or the same
    refusal as the ``json`` reading alone; Debezium's own BEGINs and ENDs take the fast path."""
    from spark_apps.eos_stream.cdc import fast_envelope

    read = _transaction_outcome(value, transactions.parse_transaction_record)
    assert read == _transaction_outcome(value, transactions._parse_with_json)
    if _FAST_CASES.index(value) < 4:
        assert fast_envelope.transaction_record(value) is not None and isinstance(read, transactions.TransactionRecord)


def _as_connect_writes(payload: object) -> bytes:
    """A transaction record with its schema, compact, as Connect's JSON converter writes it."""
    return json.dumps({"schema": {"type": "struct", "fields": [], "name": "tx"}, "payload": payload},
                      separators=(",", ":")).encode()


def _collections(*entries: tuple[object, object]) -> list[dict[str, object]]:
    return [{"data_collection": t, "event_count": n} for t, n in entries]


_HEAD_CASES = [
    {"status": "END", "id": "571:9", "data_collections": _collections(("public.a", 2), ("public.b", 1))},
    {"status": "END", "id": "571:9", "data_collections": _collections(("public.a", 1), ("public.a", 2))},
    {"status": "END", "id": "572:9", "data_collections": _collections(("public.a", 0), ("other.skip", 4))},
    {"status": "END", "id": "573:9", "data_collections": []},
    {"status": "BEGIN", "id": "574:9", "data_collections": None},
    {"status": "BEGIN", "id": "575:9", "data_collections": "not a list"},
    {"status": "END", "id": "576:9", "data_collections": None},
    {"status": "END", "id": "577:9", "data_collections": _collections(("public.a", -1))},
    {"status": "END", "id": "578:9", "data_collections": _collections(("public.a", True))},
    {"status": "END", "id": "579:9", "data_collections": "not a list"},
    {"status": "END", "id": 580, "data_collections": []},
    {"status": "END", "id": ":9", "data_collections": []},
    {"status": "COMMIT", "id": "581:9"},
    {"status": "END"},
]


@pytest.mark.parametrize("payload", _HEAD_CASES)
def test_a_counted_transaction_record_agrees_with_the_reference_reading(payload: dict) -> None:
    """A whole mirror's stager counts a BEGIN or an END from its head (``fast_envelope.transaction_head``,
    its ``data_collections`` text read once per text), or gives the verdict of the reference reading:
    the same group, skip or refusal, with the tables the mirror does not read left out."""
    from spark_apps.eos_stream.cdc import fast_envelope
    from spark_apps.eos_stream.cdc.envelope import EnvelopeError
    from spark_apps.eos_stream.cdc.transaction_groups import GroupCounter

    def mirrored(table: str) -> bool:
        return not table.startswith("other.")

    fast_envelope.transaction_record(_as_connect_writes(_HEAD_CASES[0]))  # its schema prefix, now known
    value = _as_connect_writes(payload)
    counted, expected = GroupCounter(), GroupCounter()
    try:
        reference = transactions._parse_with_json(value)
    except ValueError:
        with pytest.raises(EnvelopeError):
            mirror._count_transaction_record(counted, TX, 0, 7, value, mirror._EndCounts(mirrored))
        return
    mirror._count_transaction_record(counted, TX, 0, 7, value, mirror._EndCounts(mirrored))
    if reference.status == END:
        expected.end(TX, 0, 7, reference.tx, mirror._EndCounts(mirrored)(reference.counts))
    else:
        expected.skip()
    assert list(counted.groups()) == list(expected.groups()) and counted.unstaged == expected.unstaged == 1
    if _HEAD_CASES.index(payload) < 6:  # Debezium's own: counted from the head
        assert fast_envelope.transaction_head(value) is not None


def _change(op: str, key: int, tx: str | None, schemas: bool = False, lsn: int = 5) -> tuple[bytes, bytes]:
    payload = {"op": op, "before": None, "after": {"id": key, "owner": "x", "balance": "1"},
               "source": {"schema": "public", "table": "accounts", "txId": 7, "snapshot": "false"},
               "transaction": None if tx is None else {"id": f"{tx}:{lsn}", "total_order": 1,
                                                        "data_collection_order": 1}}
    value = {"schema": {"type": "struct", "fields": []}, "payload": payload} if schemas else payload
    return json.dumps({"id": key}).encode(), json.dumps(value).encode()


def test_a_change_carries_its_transaction_by_either_reading_and_a_snapshot_read_none() -> None:
    for schemas in (False, True):
        raw = parse_envelope(*_change("u", 1, "571", schemas, lsn=123))
        assert raw is not None and raw.transaction == "571"
        raw = parse_envelope(*_change("r", 1, None, schemas))
        assert raw is not None and raw.transaction is None
    key, value = _change("u", 1, "571")
    document = json.loads(value)
    document["junk"] = float("nan")  # the fast path refuses NaN: the reference reads it
    raw = parse_envelope(key, json.dumps(document).encode())
    assert raw is not None and raw.transaction == "571"


SECTION = {"topic_prefix": "app", "transactions": "whole", "tables": [
    {"source": "public.accounts", "key": ["id"], "columns": {"id": "bigint", "owner": "text",
                                                            "balance": "numeric(20,6)"}}]}


def _staged(records: list[tuple[str, int, int, bytes | None, bytes | None]]) -> list[dict[str, str]]:
    definition = parse_mirror(SECTION)
    lines = mirror.resolved_staging_lines(Router(definition).resolve, records, False,
                                          transactions.transaction_topic("app"), definition.mirrors)
    return [dict(zip(mirror.STAGE_COLUMNS, line.rstrip("\n").split("\t"), strict=True)) for line in lines]


def test_staging_gives_each_change_its_transaction_and_table_and_an_end_its_counts() -> None:
    refused = json.loads(_change("u", 3, "571")[1])
    refused["after"]["balance"] = 1.5  # a numeric as a JSON number: refused, still counted
    rows = _staged([(DATA, 0, 0, *_change("c", 1, "571")), (DATA, 0, 1, *_change("r", 2, None)),
                    (DATA, 0, 2, b'{"id": 3}', json.dumps(refused).encode()),
                    (TX, 0, 0, b"k", b'{"status": "BEGIN", "id": "571:1"}'),
                    (TX, 0, 1, b"k", _end("571", {"public.accounts": 2, "public.audit": 3}))])
    assert [(r["_op"], r["_tx"], r["_collection"]) for r in rows] == [
        ("c", "571", "public.accounts"), ("r", "\\N", "public.accounts"), ("\\N", "571", "public.accounts"),
        ("\\N", "\\N", "\\N"), (END, "571", "\\N")]
    # public.audit is captured by the connector, not mirrored: its events never come, so they are not awaited
    assert rows[2]["_error"] != "\\N" and rows[4]["_after"] == '{"public.accounts":2}'
    assert _staged([(TX, 0, 0, b"k", b"oops")])[0]["_error"].startswith("malformed transaction record")


def test_the_transactions_setting_is_checked_and_names_the_choices() -> None:
    assert parse_mirror({**SECTION, "transactions": "per_key"}).transaction_topic() is None
    assert parse_mirror(SECTION).transaction_topic() == "app.transaction"
    assert not parse_mirror({k: v for k, v in SECTION.items() if k != "transactions"}).whole_transactions
    with pytest.raises(MirrorError, match=r"mirror.transactions: must be one of per_key, whole, got 'all'"):
        parse_mirror({**SECTION, "transactions": "all"})


# --- the walk -------------------------------------------------------------------

def _c(partition: int, offset: int, tx: str | None, table: str = "public.a") -> Candidate:
    return Candidate((DATA, partition, offset), "change" if tx else "free", tx, table)


def _e(offset: int, tx: str, counts: dict[str, int]) -> Candidate:
    return Candidate((TX, 0, offset), END, tx, None, counts)


def test_a_transaction_applies_only_once_its_end_and_all_its_events_are_there() -> None:
    first = [_c(0, 0, "1"), _c(1, 0, "1", "public.b"), _e(0, "1", {"public.a": 1, "public.b": 2})]
    result = plan(first)
    assert result.applicable == [] and result.waiting == ["1"]
    assert result.held == {c.coordinate for c in first}
    second = [*first, _c(1, 1, "1", "public.b")]
    result = plan(second)
    assert result.applicable == ["1"] and result.held == set()


def test_a_later_transaction_waits_for_an_earlier_incomplete_one() -> None:
    candidates = [_c(0, 0, "1"), _c(1, 0, "2"), _e(0, "1", {"public.a": 2}), _e(1, "2", {"public.a": 1})]
    result = plan(candidates)
    assert result.applicable == [] and result.waiting == ["1", "2"]
    assert result.held == {c.coordinate for c in candidates}


def test_an_end_without_events_applies_and_data_without_an_end_is_held() -> None:
    result = plan([_e(0, "1", {}), _c(0, 0, "2")])
    assert result.applicable == ["1"] and result.held == {(DATA, 0, 0)}


def test_a_free_record_applies_unless_it_follows_a_held_one_in_its_partition() -> None:
    candidates = [_c(0, 0, None), _c(0, 1, "1"), _c(0, 2, None), _c(1, 0, None), _e(0, "1", {"public.a": 2})]
    result = plan(candidates)
    assert result.held == {(DATA, 0, 1), (DATA, 0, 2), (TX, 0, 0)}
    assert result.applied(candidates) == [(DATA, 0, 0), (DATA, 1, 0)]


def test_more_events_than_the_end_counts_fail_naming_the_transaction() -> None:
    with pytest.raises(TransactionError, match=r"source transaction 1: more change events of \['public.b'\]"):
        plan([_c(0, 0, "1"), _c(0, 1, "1", "public.b"), _e(0, "1", {"public.a": 1})])


def test_a_complete_transaction_behind_a_held_event_of_its_partition_is_refused() -> None:
    # Impossible in commit order: 9's END is lost, or a key moved partitions while the mirror was behind.
    with pytest.raises(TransactionError, match=r"2 is complete, but its event .* of transaction 9, whose END"):
        plan([_c(0, 0, "9"), _c(0, 1, "2"), _e(0, "2", {"public.a": 1})])


def test_held_changes_has_a_stage_s_columns_after_the_pipeline() -> None:
    from spark_apps.eos_stream.state import meta_tables

    ddl = next(s for s in meta_tables.ddl_statements("m") if meta_tables.HELD_CHANGES in repr(s))
    text = repr(ddl)
    positions = [text.index(f" {column} ") for column in ("pipeline", *mirror.STAGE_COLUMNS)]
    assert positions == sorted(positions)


def test_the_transaction_topic_must_exist_with_one_partition() -> None:
    from spark_apps.eos_stream.run.preflight import transaction_topic_problem

    assert transaction_topic_problem(None, {}) is None
    assert transaction_topic_problem(TX, {TX: [0], DATA: [0, 1]}) is None
    assert "does not exist" in str(transaction_topic_problem(TX, {DATA: [0]}))
    assert "has 3 partitions" in str(transaction_topic_problem(TX, {TX: [0, 1, 2]}))
    assert transaction_topic_problem(TX, {TX: [0], DATA: [0]}, {(DATA, 0): 5, (TX, 0): 2}) is None
    assert "ran with transactions: per_key" in str(transaction_topic_problem(TX, {TX: [0], DATA: [0]}, {(DATA, 0): 5}))


# The source settings postgres_connector_config reads, as stack.env names them.
CONNECTOR_SOURCE = dict.fromkeys(("EOS_PG_HOST", "EOS_PG_PORT", "EOS_SOURCE_PG_USER", "EOS_CONNECT_SOURCE_SECRETS",
                                  "EOS_SOURCE_PG_DB", "EOS_SOURCE_PUBLICATION"), "x")


def test_the_connector_config_writes_the_transaction_topic_in_one_partition() -> None:
    import re

    from airflow_provider_eos.utils.debezium_config import postgres_connector_config

    config = postgres_connector_config(CONNECTOR_SOURCE, "app", "slot", ["public.accounts"])
    assert config["provide.transaction.metadata"] == "true"
    group = config["topic.creation.groups"]
    assert re.fullmatch(config[f"topic.creation.{group}.include"], TX)
    assert not re.fullmatch(config[f"topic.creation.{group}.include"], DATA)
    assert config[f"topic.creation.{group}.partitions"] == 1


def test_the_connector_config_drops_the_transaction_topics_begins_unless_told_not_to() -> None:
    from airflow_provider_eos.utils.debezium_config import TRANSACTION_BEGIN_PREDICATE, postgres_connector_config

    config = postgres_connector_config(CONNECTOR_SOURCE, "app", "slot", ["public.accounts"])
    [transform] = config["transforms"].split(",")
    assert config[f"transforms.{transform}.type"] == "org.apache.kafka.connect.transforms.Filter"
    predicate = config[f"transforms.{transform}.predicate"]
    assert config["predicates"] == predicate
    assert config[f"predicates.{predicate}.type"] == TRANSACTION_BEGIN_PREDICATE
    assert config[f"predicates.{predicate}.topic"] == TX

    kept = postgres_connector_config(CONNECTOR_SOURCE, "app", "slot", ["public.accounts"],
                                     drop_transaction_begins=False)
    assert not any(key.startswith(("transforms", "predicates")) for key in kept)
    assert kept["provide.transaction.metadata"] == "true"
