"""Provider metadata that Airflow's ProvidersManager reads through the entry point."""

from __future__ import annotations

from typing import Any

from airflow_provider_eos import __version__
from airflow_provider_eos.utils.provider_config import provider_config

INTEGRATION = "Exactly-once streaming"
HOOKS = [
    "airflow_provider_eos.hooks.kafka_offsets",
    "airflow_provider_eos.hooks.kafka_transactions",
    "airflow_provider_eos.hooks.eos_postgres",
    "airflow_provider_eos.hooks.stream_submit",
    "airflow_provider_eos.hooks.pg_tools",
    "airflow_provider_eos.hooks.kafka_connect",
    "airflow_provider_eos.hooks.replication_slot",
]
OPERATORS = [
    "airflow_provider_eos.operators.stream",
    "airflow_provider_eos.operators.stop",
    "airflow_provider_eos.operators.dead_letters",
    "airflow_provider_eos.operators.hanging_transactions",
    "airflow_provider_eos.operators.snapshot",
    "airflow_provider_eos.operators.restore",
    "airflow_provider_eos.operators.replay",
    "airflow_provider_eos.operators.audit",
    "airflow_provider_eos.operators.cdc_health",
]
SENSORS = ["airflow_provider_eos.sensors.lso_lag", "airflow_provider_eos.sensors.stream_progress"]
TRIGGERS = [
    "airflow_provider_eos.triggers.committed_offsets",
    "airflow_provider_eos.triggers.lso_lag",
    "airflow_provider_eos.triggers.stream_progress",
    "airflow_provider_eos.triggers.stream_stopped",
]

# Kafka Connect's REST API: host, port and scheme (http/https) of any worker.
CONNECTION_TYPES = [
    {
        "hook-class-name": "airflow_provider_eos.hooks.kafka_connect.KafkaConnectHook",
        "connection-type": "kafka_connect",
    },
]

EXTRA_LINKS = ["airflow_provider_eos.links.spark_ui.SparkDriverUILink"]


def get_provider_info() -> dict[str, Any]:
    return {
        # Must equal the canonical distribution name, or discovery rejects it.
        "package-name": "airflow-provider-eos",
        "name": "Exactly-once streaming (Kafka -> Spark -> PostgreSQL)",
        "description": "Launch, supervise, check, snapshot and recover exactly-once "
        "Kafka -> Spark Structured Streaming -> PostgreSQL pipelines.",
        "versions": [__version__],
        # No documentation URL: the docs ship in the repository (README.md, docs/), not on a site.
        "integrations": [{"integration-name": INTEGRATION, "tags": ["software"]}],
        "hooks": [{"integration-name": INTEGRATION, "python-modules": HOOKS}],
        "operators": [{"integration-name": INTEGRATION, "python-modules": OPERATORS}],
        "sensors": [{"integration-name": INTEGRATION, "python-modules": SENSORS}],
        "triggers": [{"integration-name": INTEGRATION, "python-modules": TRIGGERS}],
        "connection-types": CONNECTION_TYPES,
        "extra-links": EXTRA_LINKS,
        # Deployment settings ([eos] in airflow.cfg): where snapshots and pipeline configs live.
        "config": provider_config(),
    }
