"""What a ``kafka`` connection gives the code that is not a Kafka client itself: the app's
and the lineage's bootstrap servers, and the security options the app's clients need. The
connection's extra (librdkafka names) is the one place for them."""

from __future__ import annotations

from typing import NamedTuple

from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook
from airflow.sdk.exceptions import AirflowFailException


class KafkaClientSettings(NamedTuple):
    """A connection's bootstrap servers and its security options (librdkafka names; secrets)."""

    bootstrap: str
    security: dict[str, str]


def kafka_client_settings(kafka_config_id: str) -> KafkaClientSettings:
    """What the app needs of a ``kafka`` connection: ``bootstrap.servers`` and every
    ``security.*``, ``sasl.*`` and ``ssl.*`` option of its extra. The app uses them as they are
    for its own librdkafka clients and translates them for Spark's Java source
    (``spark_apps.eos_stream.kafka.security``); they hold secrets, so they travel only in the
    app's environment."""
    from spark_apps.eos_stream.kafka.security import security_options

    extra = dict(KafkaBaseHook.get_connection(kafka_config_id).extra_dejson or {})
    bootstrap = extra.get("bootstrap.servers")
    if not bootstrap:
        raise AirflowFailException(f"connection {kafka_config_id!r} has no 'bootstrap.servers' in its extra")
    return KafkaClientSettings(str(bootstrap), security_options(extra))


def kafka_bootstrap_from_connection(kafka_config_id: str) -> str:
    """``bootstrap.servers`` from the extra of a ``kafka`` connection."""
    return kafka_client_settings(kafka_config_id).bootstrap
