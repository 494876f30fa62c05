"""The health check ``held_transactions`` of a whole-transactions mirror, against the real
PostgreSQL: changes held back longer than the limit fail it, naming the transaction, its records
and topics; changes held a moment (a transaction whose END is on its way) do not."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowException
from psycopg2 import sql

from airflow_provider_eos.operators.cdc_health import HeldTransactionsCheckOperator
from spark_apps.eos_stream.state import meta_tables
from tests.integration.test_stream_operator import airflow_conns  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


def _hold(pg_conn, meta: str, pipeline: str, tx: str, topic: str, offsets: range, seconds_ago: int) -> None:
    with pg_conn.cursor() as cur:
        for offset in offsets:
            cur.execute(sql.SQL("INSERT INTO {} (pipeline, _topic, _partition, _offset, _tx, held_at)"
                                " VALUES (%s, %s, 0, %s, %s, now() - make_interval(secs => %s))").format(
                meta_tables.table(meta, meta_tables.HELD_CHANGES)), (pipeline, topic, offset, tx, seconds_ago))


def _check(meta: str, pipeline: str, limit: float) -> dict:
    return HeldTransactionsCheckOperator(task_id="held_transactions", pipeline=pipeline, meta_schema=meta,
                                         max_wait_seconds=limit).execute({})


def test_a_transaction_held_past_the_limit_fails_by_name(airflow_conns, pg_conn, meta) -> None:  # noqa: F811
    _hold(pg_conn, meta, "bank", "771", "app.public.accounts", range(10, 14), seconds_ago=900)
    _hold(pg_conn, meta, "bank", "771", "app.public.ledger", range(3, 5), seconds_ago=899)
    _hold(pg_conn, meta, "bank", "772", "app.public.ledger", range(5, 7), seconds_ago=2)
    _hold(pg_conn, meta, "other", "990", "app.public.ledger", range(5, 7), seconds_ago=3000)  # another pipeline's
    with pytest.raises(AirflowException) as failed:
        _check(meta, "bank", 300)
    message = str(failed.value)
    assert "has held 1 source transaction(s) longer than 300s" in message, message
    assert "transaction 771: 6 change(s) from app.public.accounts, app.public.ledger, held 900s" in message, message
    assert "772" not in message and "990" not in message
    assert "provide.transaction.metadata=true" in message


def test_changes_held_a_moment_pass(airflow_conns, pg_conn, meta) -> None:  # noqa: F811
    _hold(pg_conn, meta, "bank", "772", "app.public.ledger", range(5, 7), seconds_ago=2)
    result = _check(meta, "bank", 300)
    assert result["count"] == 0 and result["message"] == "no source transaction held longer than 300s"
