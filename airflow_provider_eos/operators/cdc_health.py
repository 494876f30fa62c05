"""Health checks of a change-data-capture source: the Kafka Connect connector that publishes
the changes, the replication slot it reads the source database through, and, for a mirror of
whole source transactions, the transactions it has held back too long.

Like the other checks of a health DAG (``operators/dead_letters.py``), each records its
outcome as the XCom ``eos_check`` before it succeeds or fails, so the summary task can say why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.hooks.kafka_connect import ConnectorUnhealthyError, KafkaConnectHook
from airflow_provider_eos.hooks.replication_slot import ReplicationSlotHook
from airflow_provider_eos.operators.base import CheckOutcomeMixin
from airflow_provider_eos.state.held_changes import held_transactions
from airflow_provider_eos.utils.cdc_health import (
    DEFAULT_MAX_AGE_SECONDS,
    DEFAULT_MAX_HELD_BYTES,
    describe_slot,
    slot_problems,
)


class ConnectorHealthCheckOperator(CheckOutcomeMixin, BaseOperator):
    """
    Fails unless each connector and every one of its tasks is RUNNING, naming the connector, the
    task and its state (PAUSED, STOPPED, UNASSIGNED, RESTARTING) or, for FAILED, its trace.

    :param connectors: connector names (one name or a list).
    :param kafka_connect_conn_id: Connect's REST API, default "kafka_connect_default".
    :return: (XCom) ``{"connectors": {name: status}}``
    """

    template_fields: Sequence[str] = ("connectors", "kafka_connect_conn_id")
    check_name = "connector"

    def __init__(self, *, connectors: str | Sequence[str],
                 kafka_connect_conn_id: str = KafkaConnectHook.default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.connectors = connectors
        self.kafka_connect_conn_id = kafka_connect_conn_id

    def execute(self, context: Any) -> Any:
        return self._recorded(context, self._check)

    def _check(self) -> dict[str, Any]:
        hook = KafkaConnectHook(kafka_connect_conn_id=self.kafka_connect_conn_id)
        names = [self.connectors] if isinstance(self.connectors, str) else list(self.connectors)
        statuses: dict[str, Any] = {}
        problems: list[str] = []
        for name in names:
            found = hook.connector_problems(name)
            problems += found
            if not found:
                statuses[name] = hook.get_connector_status(name)
        if problems:
            self.last_report = {"connectors": statuses, "problems": problems}
            raise ConnectorUnhealthyError("\n".join(problems))
        return {"connectors": statuses, "message": f"{len(names)} connector(s) and their tasks RUNNING"}


class ReplicationSlotCheckOperator(CheckOutcomeMixin, BaseOperator):
    """
    Fails when the source's replication slot is missing, has lost WAL, holds back more than
    ``max_held_bytes`` of WAL (current LSN minus its ``restart_lsn``), or its oldest held WAL is
    older than ``max_age_seconds``; the message names the slot, the bytes and the age.

    :param slot_name: the slot (Debezium's ``slot.name``).
    :param postgres_conn_id: the source database (role with ``pg_monitor`` for the age).
    :param max_held_bytes: WAL the slot may hold back.
    :param max_age_seconds: age the oldest held WAL may reach; None judges bytes only.
    :return: (XCom) the slot's measures (``held_bytes``, ``age_seconds``, ``active``...)
    """

    template_fields: Sequence[str] = ("slot_name", "postgres_conn_id", "max_held_bytes", "max_age_seconds")
    check_name = "replication_slot"

    def __init__(self, *, slot_name: str, postgres_conn_id: str = "postgres_default",
                 max_held_bytes: int | str = DEFAULT_MAX_HELD_BYTES,
                 max_age_seconds: float | str | None = DEFAULT_MAX_AGE_SECONDS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slot_name = slot_name
        self.postgres_conn_id = postgres_conn_id
        self.max_held_bytes = max_held_bytes
        self.max_age_seconds = max_age_seconds

    def execute(self, context: Any) -> Any:
        return self._recorded(context, self._check)

    def _check(self) -> dict[str, Any]:
        state = ReplicationSlotHook(postgres_conn_id=self.postgres_conn_id).slot_state(self.slot_name)
        max_age = None if self.max_age_seconds in (None, "", "None") else float(self.max_age_seconds)
        problems = slot_problems(state, self.slot_name, int(self.max_held_bytes), max_age)
        report = state.as_report() if state else {"slot": self.slot_name, "exists": False}
        if problems:
            self.last_report = report
            raise AirflowException("\n".join(problems))
        assert state is not None  # slot_problems reports a missing slot
        return {**report, "message": describe_slot(state)}



class HeldTransactionsCheckOperator(CheckOutcomeMixin, BaseOperator):
    """
    Fails when a mirror with ``transactions: whole`` has held a source transaction's changes longer
    than ``max_wait_seconds``, naming each such transaction, its records and their topics. A
    transaction's changes wait only until its ``END`` reaches the connector's transaction topic, a
    matter of seconds; a longer wait means that topic stopped moving while the change topics
    moved (the connector lost ``provide.transaction.metadata``, or the topic its retention), and
    the mirror shows nothing of that transaction or any later one until it moves again.

    :param pipeline: pipeline name.
    :param postgres_conn_id: target database connection, default "eos_postgres".
    :param meta_schema: schema of the bookkeeping tables (``held_changes``).
    :param max_wait_seconds: how long a transaction may be held.
    :return: (XCom) ``{"held": [...], "count": n, "oldest_seconds": s}``
    """

    template_fields: Sequence[str] = ("pipeline", "meta_schema", "postgres_conn_id", "max_wait_seconds")
    check_name = "held_transactions"

    def __init__(self, *, pipeline: str, postgres_conn_id: str = "eos_postgres", meta_schema: str = "eos",
                 max_wait_seconds: float | str = 300, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.postgres_conn_id = postgres_conn_id
        self.meta_schema = meta_schema
        self.max_wait_seconds = max_wait_seconds

    def execute(self, context: Any) -> Any:
        return self._recorded(context, self._check)

    def _check(self) -> dict[str, Any]:
        hook = EosPostgresHook(postgres_conn_id=self.postgres_conn_id, meta_schema=self.meta_schema)
        limit = float(self.max_wait_seconds)
        held = held_transactions(hook, self.pipeline, older_than_seconds=limit)
        if not held:
            return {"held": [], "count": 0, "oldest_seconds": 0.0,
                    "message": f"no source transaction held longer than {limit:g}s"}
        self.last_report = {"held": held, "count": len(held), "oldest_seconds": held[0]["held_seconds"]}
        lines = [f"pipeline {self.pipeline!r} has held {len(held)} source transaction(s) longer than {limit:g}s, "
                 "waiting for their END in the connector's transaction topic (nothing of them, or of any later "
                 "transaction, is in the mirror yet):"]
        lines += [f"  transaction {row['transaction']}: {row['records']} change(s) from {row['topics']}, held "
                  f"{row['held_seconds']:.0f}s" for row in held]
        lines.append("Check that the connector runs with provide.transaction.metadata=true and that its "
                     "<topic.prefix>.transaction topic still receives records; an END lost for good is in "
                     "docs/cdc.md, 'When a transaction cannot apply'.")
        raise AirflowException("\n".join(lines))
