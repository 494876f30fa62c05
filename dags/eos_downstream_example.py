"""An example consumer: ``eos_example_downstream__<pipeline>`` runs each time a pipeline's target
moves, scheduled on the pipeline's target assets (``committed_assets``). Each run is told, in the
triggering Asset events, the Kafka offsets the target now holds everything below, and why it moved
(``first``, ``advanced``, ``rewound`` by a restore, or ``recovered``). Paused at creation: unpause it
to start the pipeline's committed-offsets watcher; a paused one costs nothing."""

from __future__ import annotations

from typing import Any

from airflow.sdk import DAG, get_parsing_context, task

from airflow_provider_eos.dag_factory import committed_assets, defined_pipelines
from airflow_provider_eos.dag_factory.common import START_DATE


@task
def report_committed(**context: Any) -> list[dict[str, Any]]:
    """What this run was told: one entry per triggering event (a downstream job would read the
    target up to these offsets here)."""
    seen = []
    for asset, events in context["triggering_asset_events"].items():
        for event in events:
            payload = (event.extra or {}).get("payload") or {}
            print(f"{asset.uri}: {payload.get('change')} to batch {payload.get('batch_id')}, "
                  f"offsets {payload.get('offsets')}")
            seen.append({"asset": asset.uri, **payload})
    return seen


PREFIX = "eos_example_downstream__"
# A task's parse (the parsing context names its DAG) builds only that DAG.
_wanted = get_parsing_context().dag_id or ""
for _name in defined_pipelines():
    if _wanted.startswith(PREFIX) and _wanted != PREFIX + _name:
        continue
    try:
        _targets = committed_assets(_name)
    except ValueError:
        continue  # logged: the pipeline's connections or spec are not readable here
    with DAG(dag_id=PREFIX + _name, schedule=_targets, start_date=START_DATE, catchup=False,
             is_paused_upon_creation=True, tags=["eos", f"pipeline:{_name}", "example"], doc_md=__doc__) as _dag:
        report_committed()
    globals()[_dag.dag_id] = _dag
