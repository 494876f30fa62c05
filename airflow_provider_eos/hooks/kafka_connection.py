"""What a ``kafka`` connection gives the code that is not a Kafka client itself: the app's
and the lineage's bootstrap servers. The connection's extra (librdkafka names) is the one
place for them."""

from __future__ import annotations

from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook
from airflow.sdk.exceptions import AirflowFailException


def kafka_bootstrap_from_connection(kafka_config_id: str) -> str:
    """``bootstrap.servers`` from the extra of a ``kafka`` connection."""
    conn = KafkaBaseHook.get_connection(kafka_config_id)
    bootstrap = (conn.extra_dejson or {}).get("bootstrap.servers")
    if not bootstrap:
        raise AirflowFailException(f"connection {kafka_config_id!r} has no 'bootstrap.servers' in its extra")
    return str(bootstrap)
