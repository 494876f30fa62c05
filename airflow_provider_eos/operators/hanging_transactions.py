"""Find, describe and (only when confirmed) abort hanging Kafka transactions.

The Kafka work (KIP-664's admin calls in pure Python, through kafka-python: no JVM) is in
:class:`~airflow_provider_eos.hooks.kafka_transactions.KafkaTransactionsHook`; this operator
only decides what to run and what may be aborted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.kafka_transactions import KafkaTransactionsHook

ACTIONS = ("find-hanging", "describe-producers", "abort")


class HangingTransactionsOperator(BaseOperator):
    """
    Finds, describes or aborts open Kafka transactions (the calls of Kafka's
    ``kafka-transactions.sh``, made from Python by the hook).

    * ``action='find-hanging'``: transactions that have been open longer than
      ``max_transaction_timeout_minutes`` and that their coordinator no longer
      resolves (on ``broker_id`` or ``topic`` [``partition``]; see the hook's ``find_hanging``).
    * ``action='describe-producers'``: the active producers of ``topic``/``partition``,
      including ``CurrentTransactionStartOffset`` of an open transaction.
    * ``action='abort'``: abort the transaction starting at ``start_offset`` of
      ``topic``/``partition``.

    Nothing is aborted unless ``confirm_abort=True``: without it, ``abort`` only
    describes the producers of the partition and reports what it would abort. With
    ``confirm_abort=True``, ``find-hanging`` also aborts every hanging transaction it
    finds.

    The returned XCom is a dict with ``action``, ``rows`` (the parsed table),
    ``aborted`` (list of ``{topic, partition, start_offset}``) and ``would_abort``. The rows
    have the column names of Kafka's tool (``ProducerId``, ``CurrentTransactionStartOffset``,
    ``StartOffset``, ...).

    :param action: ``find-hanging``, ``describe-producers`` or ``abort``.
    :param kafka_config_id: The connection object to use, defaults to "kafka_default"
        (``bootstrap.servers`` and security settings come from its extra).
    :param topic: topic name.
    :param partition: partition number.
    :param broker_id: broker to search (``find-hanging``).
    :param start_offset: first offset of the transaction to abort (``abort``).
    :param max_transaction_timeout_minutes: for ``find-hanging``: the broker's
        ``transaction.max.timeout.ms`` in minutes (Kafka's default 15).
    :param confirm_abort: actually abort; otherwise only report.
    :param request_timeout: seconds allowed to reach the cluster and for each admin request.
    """

    template_fields: Sequence[str] = ("action", "topic", "partition", "start_offset", "broker_id")
    ui_color = "#ffd9cc"

    def __init__(
        self,
        *,
        action: str = "find-hanging",
        kafka_config_id: str = "kafka_default",
        topic: str | None = None,
        partition: int | None = None,
        broker_id: int | None = None,
        start_offset: int | None = None,
        max_transaction_timeout_minutes: int | None = None,
        confirm_abort: bool = False,
        request_timeout: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        self.action = action
        self.kafka_config_id = kafka_config_id
        self.topic = topic
        self.partition = partition
        self.broker_id = broker_id
        self.start_offset = start_offset
        self.max_transaction_timeout_minutes = max_transaction_timeout_minutes
        self.confirm_abort = confirm_abort
        self.request_timeout = float(request_timeout)

    def hook(self) -> KafkaTransactionsHook:
        return KafkaTransactionsHook(kafka_config_id=self.kafka_config_id, request_timeout=self.request_timeout)

    def _require_partition(self) -> tuple[str, int]:
        if not self.topic or self.partition is None:
            raise AirflowException(f"{self.action} needs topic and partition")
        return self.topic, int(self.partition)

    # ---------------------------------------------------------------- execute
    def execute(self, context: Any) -> dict[str, Any]:
        hook = self.hook()
        result: dict[str, Any] = {"action": self.action, "rows": [], "aborted": [], "would_abort": []}
        if self.action == "find-hanging":
            return self._find_hanging(hook, result)
        topic, partition = self._require_partition()
        if self.action == "describe-producers":
            result["rows"] = hook.describe_producers(topic, partition)
            return result
        return self._abort(hook, result, topic, partition)

    def _find_hanging(self, hook: KafkaTransactionsHook, result: dict[str, Any]) -> dict[str, Any]:
        """Finds the hanging transactions; aborts them only with ``confirm_abort``."""
        rows = hook.find_hanging(
            broker_id=None if self.broker_id is None else int(self.broker_id),
            topic=self.topic,
            partition=None if self.partition is None else int(self.partition),
            max_transaction_timeout_minutes=self.max_transaction_timeout_minutes,
        )
        result["rows"] = rows
        targets = [
            {"topic": r["Topic"], "partition": r["Partition"], "start_offset": r["StartOffset"]} for r in rows
        ]
        if not rows:
            self.log.info("No hanging transactions found")
        elif self.confirm_abort:
            for t in targets:
                hook.abort(t["topic"], t["partition"], t["start_offset"])
            result["aborted"] = targets
        else:
            result["would_abort"] = targets
            self.log.warning(
                "%d hanging transaction(s) found; not aborting them (confirm_abort=False): %s",
                len(rows),
                targets,
            )
        return result

    def _abort(self, hook: KafkaTransactionsHook, result: dict[str, Any], topic: str,
               partition: int) -> dict[str, Any]:
        """Aborts the transaction at ``start_offset`` of one partition (only with ``confirm_abort``)."""
        if self.start_offset is None:
            raise AirflowException("abort needs start_offset (see describe-producers' CurrentTransactionStartOffset)")
        start_offset = int(self.start_offset)
        rows = hook.describe_producers(topic, partition)
        result["rows"] = rows
        target = {"topic": topic, "partition": partition, "start_offset": start_offset}
        open_here = [r for r in rows if r.get("CurrentTransactionStartOffset") == start_offset]
        if not open_here:
            self.log.warning(
                "No producer of %s[%s] has an open transaction starting at offset %s", topic, partition, start_offset
            )
        if not self.confirm_abort:
            result["would_abort"] = [target]
            self.log.warning(
                "Not aborting the transaction at %s[%s] offset %s: confirm_abort is False "
                "(only reporting). Producers: %s",
                topic,
                partition,
                start_offset,
                rows,
            )
            return result
        hook.abort(topic, partition, start_offset)
        result["aborted"] = [target]
        return result
