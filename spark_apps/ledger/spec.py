"""The shipped example pipeline: a ledger of account movements.

``ledger_events`` keeps one row per event with its Kafka coordinates;
``account_balances`` adds every amount to its account and keeps the ``seq`` of
the account's latest event. The second target is not idempotent: a duplicate or
a loss anywhere shows in the sums, and an event applied out of order in
``last_seq`` (the topic is keyed by account, so an account's events share one
partition and Kafka's order is theirs).
"""

from __future__ import annotations

from psycopg2 import sql

from spark_apps.eos_stream.records.spec import AggregateTarget, Field, PipelineSpec, RowTarget
from spark_apps.eos_stream.state.ddl import AddColumn, DdlStatement

EVENTS_TABLE = "ledger_events"
BALANCES_TABLE = "account_balances"
# A real limit of the target: an account id longer than this is rejected by the
# database itself, the shipped example of a record that poisons its batch.
ACCOUNT_ID_MAX = 64


def ledger_ddl(schema: str, unique_coordinates: bool = False) -> list[DdlStatement]:
    """CREATE statements for the ledger's targets.

    :param unique_coordinates: add the unique index idempotent delivery needs.
    """
    names = {
        "schema": sql.Identifier(schema),
        "events": sql.Identifier(EVENTS_TABLE),
        "balances": sql.Identifier(BALANCES_TABLE),
        "limit": sql.Literal(ACCOUNT_ID_MAX),
    }
    statements: list[DdlStatement] = [
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {schema}").format(**names),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {schema}.{events} ("
            " kafka_topic text NOT NULL, kafka_partition integer NOT NULL, kafka_offset bigint NOT NULL,"
            " event_id text NOT NULL, account_id varchar({limit}) NOT NULL, amount_cents bigint NOT NULL,"
            " ts timestamptz NOT NULL, seq bigint NOT NULL)"
        ).format(**names),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {schema}.{balances} ("
            " account_id varchar({limit}) PRIMARY KEY, balance_cents bigint NOT NULL,"
            " event_count bigint NOT NULL, last_seq bigint)"
        ).format(**names),
        # Balances tables created before last_seq existed get it; their accounts show
        # NULL until their next event.
        AddColumn(schema, BALANCES_TABLE, "last_seq", "bigint"),
    ]
    if unique_coordinates:
        statements.append(
            sql.SQL(
                "CREATE UNIQUE INDEX IF NOT EXISTS {index} ON {schema}.{events}"
                " (kafka_topic, kafka_partition, kafka_offset)"
            ).format(index=sql.Identifier(f"{EVENTS_TABLE}_coordinates"), **names)
        )
    return statements


_FIELDS = (
    Field("event_id", "text"),
    Field("account_id", "text"),
    Field("amount_cents", "bigint"),
    Field("ts", "timestamptz"),
    Field("seq", "bigint"),
)

LEDGER = PipelineSpec(
    name="ledger",
    fields=_FIELDS,
    targets=(
        RowTarget(EVENTS_TABLE, columns=tuple(f.name for f in _FIELDS)),
        AggregateTarget(
            BALANCES_TABLE,
            group_by=("account_id",),
            increments={"balance_cents": "amount_cents", "event_count": None},
            latest={"last_seq": "seq"},
        ),
    ),
    target_ddl=ledger_ddl,
)

# The same records into the per-event table only: the shape idempotent delivery accepts.
LEDGER_EVENTS_ONLY = PipelineSpec(
    name="ledger-events-only",
    fields=_FIELDS,
    targets=(RowTarget(EVENTS_TABLE, columns=tuple(f.name for f in _FIELDS)),),
    target_ddl=ledger_ddl,
)
