"""OpenLineage for the operators that read Kafka and write PostgreSQL: dataset names after the
OpenLineage naming conventions, and the audit's findings as data-quality assertions.

Names: a Kafka topic is ``kafka://<first bootstrap server>`` / ``<topic>``; a table is
``postgres://<host>:<port>`` / ``<database>.<schema>.<table>``, the names the Kafka and Postgres
providers' asset converters give, so Marquez joins these datasets with other DAGs' ones.

The OpenLineage classes are imported only when a method here builds them: the operators call
these from ``get_openlineage_facets_on_*``, which only the OpenLineage provider's listener calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def first_bootstrap_server(bootstrap_servers: str) -> str:
    """The server that names a Kafka cluster in dataset names and asset URIs."""
    return bootstrap_servers.split(",")[0].strip()


def kafka_dataset_name(bootstrap_servers: str, topic: str) -> tuple[str, str]:
    """(namespace, name) of a topic."""
    return f"kafka://{first_bootstrap_server(bootstrap_servers)}", topic


def postgres_dataset_name(target: Mapping[str, Any], schema: str, table: str) -> tuple[str, str]:
    """(namespace, name) of a table; ``target`` has host, port and dbname (``EosPostgresHook.app_target``)."""
    return f"postgres://{target['host']}:{int(target['port'])}", f"{target['dbname']}.{schema}.{table}"


def audit_assertions(report: Mapping[str, Any], table: str, aggregate: bool) -> list[dict[str, Any]]:
    """What the audit proved (or disproved) about one target table, as OpenLineage assertions:
    row targets get ``no_duplicates`` and ``no_missing`` (against every record Kafka committed),
    aggregate targets ``aggregates_exact``; both ``no_valid_record_quarantined``."""
    summary = report.get("summary") or {}
    checks: list[tuple[str, Any, Any]] = []
    if aggregate:
        totals = (report.get("aggregates") or {}).get(table) or {}
        wrong = totals.get("keys_wrong")
        checks.append(("aggregates_exact", wrong, 0))  # None: not verifiable (see the audit's 'unverified')
    else:
        checks.append(("no_duplicates", summary.get("duplicated"), 0))
        checks.append(("no_missing", summary.get("missing"), 0))
    checks.append(("no_valid_record_quarantined", summary.get("wrongly_quarantined"), 0))
    return [{"assertion": name, "success": actual == expected, "expected": str(expected), "actual": str(actual)}
            for name, actual, expected in checks]


def operator_lineage(bootstrap_servers: str, topics: Iterable[str], target: Mapping[str, Any], schema: str,
                     targets: Iterable[Any], audit: Mapping[str, Any] | None = None, write: bool = True) -> Any:
    """An ``OperatorLineage``: the topics as inputs; the tables as outputs when the operator writes
    them (``write``), else as inputs (the audit reads them), with the audit's assertions when given.

    :param targets: the spec's targets (``RowTarget``/``AggregateTarget``: ``table``, ``aggregate``).
    """
    from airflow.providers.common.compat.openlineage.facet import Dataset
    from airflow.providers.openlineage.extractors import OperatorLineage
    from openlineage.client.facet_v2 import data_quality_assertions_dataset as quality

    topic_sets = [Dataset(*kafka_dataset_name(bootstrap_servers, topic)) for topic in topics]
    tables = []
    for spec_target in targets:
        facets: dict[str, Any] = {}
        if audit is not None:
            facets["dataQualityAssertions"] = quality.DataQualityAssertionsDatasetFacet(assertions=[
                quality.Assertion(**a) for a in audit_assertions(audit, spec_target.table, spec_target.aggregate)])
        tables.append(Dataset(*postgres_dataset_name(target, schema, spec_target.table), facets=facets))
    if write:
        return OperatorLineage(inputs=topic_sets, outputs=tables)
    return OperatorLineage(inputs=[*topic_sets, *tables], outputs=[])
