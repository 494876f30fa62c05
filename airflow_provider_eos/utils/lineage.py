"""OpenLineage for the operators that read Kafka and write PostgreSQL: dataset names after the
OpenLineage naming conventions, and the audit's findings as data-quality assertions.

Names: a Kafka topic is ``kafka://<first bootstrap server>`` / ``<topic>``; a table is
``postgres://<host>:<port>`` / ``<database>.<schema>.<table>``, the names the Kafka and Postgres
providers' asset converters give, so Marquez joins these datasets with other DAGs' ones.

The OpenLineage classes are imported only when a method here builds them: the operators call
these from ``get_openlineage_facets_on_*``, which only the OpenLineage provider's listener calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from spark_apps.eos_stream.kafka.metadata import TOPIC_NAME


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


def written_tables(spec: Any) -> list[tuple[str, bool | None]]:
    """(table, aggregate) of every table a pipeline's spec writes: its targets', or a mirror's
    tables and aggregates with None, since a mirror's audit compares offsets, not rows, and so
    asserts nothing about them (``audit/mirror.py``)."""
    if spec.mirror is not None:
        return [(table, None) for table in spec.target_tables()]
    return [(t.table, t.aggregate) for t in spec.targets]


def topics_read(entries: list[str], resolve: Callable[[list[str]], list[str]]) -> list[str]:
    """The topics a pipeline reads, for lineage: its subscription regex, if any, replaced by the
    topics it matches now (``resolve``, e.g. ``KafkaOffsetsHook.resolve_topics``); only the named
    topics when Kafka cannot be asked, since lineage must never fail a task."""
    if all(TOPIC_NAME.fullmatch(entry) for entry in entries):
        return list(entries)
    try:
        return resolve(entries)
    except Exception:  # lineage is best effort: the task's own work reports Kafka's state
        return [entry for entry in entries if TOPIC_NAME.fullmatch(entry)]


def operator_lineage(bootstrap_servers: str, topics: Iterable[str], target: Mapping[str, Any], schema: str,
                     spec: Any, audit: Mapping[str, Any] | None = None, write: bool = True) -> Any:
    """An ``OperatorLineage``: the topics as inputs; the tables as outputs when the operator writes
    them (``write``), else as inputs (the audit reads them), with the audit's assertions when given.

    :param spec: the pipeline's spec (``PipelineSpec``): its tables, by ``written_tables``.
    """
    from airflow.providers.common.compat.openlineage.facet import Dataset
    from airflow.providers.openlineage.extractors import OperatorLineage
    from openlineage.client.facet_v2 import data_quality_assertions_dataset as quality

    topic_sets = [Dataset(*kafka_dataset_name(bootstrap_servers, topic)) for topic in topics]
    tables = []
    for table, aggregate in written_tables(spec):
        facets: dict[str, Any] = {}
        if audit is not None and aggregate is not None:
            facets["dataQualityAssertions"] = quality.DataQualityAssertionsDatasetFacet(assertions=[
                quality.Assertion(**a) for a in audit_assertions(audit, table, aggregate)])
        tables.append(Dataset(*postgres_dataset_name(target, schema, table), facets=facets))
    if write:
        return OperatorLineage(inputs=topic_sets, outputs=tables)
    return OperatorLineage(inputs=[*topic_sets, *tables], outputs=[])
