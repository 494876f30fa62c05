"""The DAG factory: one pipeline definition yields all of that pipeline's DAGs.

A deployment's DAG file is two lines::

    from airflow_provider_eos.dag_factory import pipeline_dags
    globals().update(pipeline_dags())

For every definition in ``[eos] pipeline_config_dir`` (see
:mod:`airflow_provider_eos.utils.pipeline_definition`) it builds ``eos_stream__<name>``,
``eos_stop__<name>``, ``eos_health__<name>``, ``eos_snapshot__<name>`` and
``eos_recovery__<name>``. ``committed_assets(name)`` gives a downstream DAG the pipeline's target
assets to be scheduled on. A definition that does not validate gets one ``eos_invalid__<file>``
DAG whose only task fails with the error, and the other pipelines keep their DAGs: one team's
typo never takes another team's recovery DAG away. When two definitions claim the same target
table, meta schema or checkpoint directory, the older definition file keeps its DAGs and only the
newcomer is refused (``pipeline_definition.seniority``). Parsing reads the definition files and the
provider config, never an environment variable of its own.

When Airflow parses the file to run one task, its parsing context names the task's DAG
(``airflow.sdk.get_parsing_context``): then only that DAG is built, and only its builder's module
is imported, so a task's start costs the same with one pipeline or a hundred. Every definition is
still loaded and checked, so a task sees the same valid pipelines as the DAG processor.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, get_parsing_context, task

from airflow_provider_eos.dag_factory.assets import PipelineAssets, committed_assets, pipeline_assets
from airflow_provider_eos.dag_factory.common import KINDS, START_DATE, dag_id
from airflow_provider_eos.utils import provider_config
from airflow_provider_eos.utils.definition_folder import definition_files, load_definitions
from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition

__all__ = ["build_pipeline_dags", "committed_assets", "dag_id", "defined_pipelines", "pipeline_dags"]

log = logging.getLogger(__name__)


def build_pipeline_dag(kind: str, definition: PipelineDefinition, assets: PipelineAssets | None = None) -> DAG:
    """The DAG of ``kind`` (one of ``common.KINDS``) of one pipeline. Its builder's module is
    imported here, not at the top: a task's parse imports what its own DAG needs and no more (the
    recovery's ``TriggerDagRunOperator`` alone costs a second). The stream reads its topic assets;
    the recovery announces its target assets (``assets``, else made from the definition: see :mod:`.assets`)."""
    if kind == "stream":
        from airflow_provider_eos.dag_factory.stream import build_stream_dag
        return build_stream_dag(definition, assets or pipeline_assets(definition))
    if kind == "stop":
        from airflow_provider_eos.dag_factory.stream import build_stop_dag
        return build_stop_dag(definition)
    if kind == "health":
        from airflow_provider_eos.dag_factory.health import build_health_dag
        return build_health_dag(definition)
    if kind == "snapshot":
        from airflow_provider_eos.dag_factory.snapshot import build_snapshot_dag
        return build_snapshot_dag(definition)
    if kind == "recovery":
        from airflow_provider_eos.dag_factory.recovery import build_recovery_dag
        return build_recovery_dag(definition, assets or pipeline_assets(definition))
    raise ValueError(f"unknown DAG kind {kind!r}; one of {KINDS}")


def build_pipeline_dags(definition: PipelineDefinition) -> list[DAG]:
    """The stream, stop, health, snapshot and recovery DAGs of one pipeline (its assets made once)."""
    assets = pipeline_assets(definition)
    return [build_pipeline_dag(kind, definition, assets) for kind in KINDS]


def _task_dag(definitions: dict[str, PipelineDefinition]) -> tuple[str, PipelineDefinition] | None:
    """The kind and pipeline of the DAG Airflow parses this file for, when it runs one of its
    tasks (the parsing context); None when it parses for every DAG (the DAG processor, ``dag.test``,
    a CLI) or the DAG is none of these pipelines' (an ``eos_invalid__`` one)."""
    wanted = get_parsing_context().dag_id
    if not wanted:
        return None
    for kind in KINDS:
        prefix = dag_id(kind, "")
        name = wanted[len(prefix):] if wanted.startswith(prefix) else None
        if name in definitions:
            return kind, definitions[name]
    return None


@task
def refuse_invalid_definition(error: str) -> Any:
    raise ValueError(error)


def _invalid_dag(file_name: str, error: str) -> DAG:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(file_name).stem) or "unnamed"
    doc = f"**This pipeline definition does not validate.**\n\n```\n{error}\n```"
    # The error is the description too: `airflow dags list` and the UI's DAG list show why.
    with DAG(dag_id=f"eos_invalid__{stem}", schedule=None, start_date=START_DATE, catchup=False,
             tags=["eos", "invalid"], doc_md=doc, description=error) as dag:
        refuse_invalid_definition(error)
    return dag


# The invalid DAG of a definition directory that is missing or holds no definition.
NO_DEFINITIONS = "pipeline_config_dir"


def _definitions(directory: str | Path | None) -> tuple[dict[str, PipelineDefinition], dict[str, str]]:
    root = Path(directory or provider_config.pipeline_config_dir())
    if not root.is_dir():
        return {}, {NO_DEFINITIONS: f"no pipeline definition directory at {root}: create it, or set "
                                    "[eos] pipeline_config_dir to the directory of your <pipeline>.yaml files"}
    if not definition_files(root):
        return {}, {NO_DEFINITIONS: f"no pipeline definition in {root} (no .yaml, .yml or .json file): add "
                                    "one per pipeline (docs/howto_own_spec.md), or set [eos] pipeline_config_dir"}
    return load_definitions(root)


def defined_pipelines(directory: str | Path | None = None) -> dict[str, PipelineDefinition]:
    """The valid pipeline definitions in ``directory`` (default ``[eos] pipeline_config_dir``), by name
    (none when the directory is missing or empty: ``pipeline_dags`` says so)."""
    return _definitions(directory)[0]


def pipeline_dags(directory: str | Path | None = None) -> dict[str, DAG]:
    """Every DAG of every pipeline defined in ``directory`` (default ``[eos] pipeline_config_dir``),
    by DAG id. A missing or empty directory yields one ``eos_invalid__pipeline_config_dir`` DAG and
    an ERROR log that say so (the DAG file still imports: never silence, never an import error)."""
    definitions, errors = _definitions(directory)
    one = _task_dag(definitions)
    if one is not None:
        dag = build_pipeline_dag(*one)
        return {dag.dag_id: dag}
    dags: dict[str, DAG] = {}
    for definition in definitions.values():
        for dag in build_pipeline_dags(definition):
            dags[dag.dag_id] = dag
    for file_name, error in errors.items():
        log.error("eos: %s", error)
        dag = _invalid_dag(file_name, error)
        dags[dag.dag_id] = dag
    return dags
