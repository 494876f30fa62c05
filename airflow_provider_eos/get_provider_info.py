"""Provider metadata that Airflow's ProvidersManager reads through the entry point."""

from __future__ import annotations

from typing import Any

from airflow_provider_eos import __version__


def get_provider_info() -> dict[str, Any]:
    return {
        # Must equal the canonical distribution name, or discovery rejects it.
        "package-name": "airflow-provider-eos",
        "name": "Exactly-once streaming (Kafka -> Spark -> PostgreSQL)",
        "description": "Launch, supervise, check, snapshot and recover exactly-once "
        "Kafka -> Spark Structured Streaming -> PostgreSQL pipelines.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Exactly-once streaming",
                "external-doc-url": "https://github.com/",
                "tags": ["software"],
            }
        ],
        "hooks": [],
        "operators": [],
        "sensors": [],
        "triggers": [],
    }
