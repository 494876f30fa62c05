"""Checks of pipeline definitions that one field's validator cannot make: a schedule Airflow
would refuse (:mod:`.schedules`, checked with the field), a spec that does not import, and two
pipelines that would write the same place.

They run when the DAG processor reads the definitions (``definition_folder.load_definitions``) and in
``eos validate``, so a broken definition fails before it is deployed or, at the latest, when it
is parsed, with a message that names its file, and never at 3 a.m. in a task.

Nothing here imports Airflow.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition

def load_spec(reference: str) -> Any:
    """The PipelineSpec that ``module:ATTRIBUTE`` names (the app's own ``spec.load_spec``).

    :raises ValueError: it does not import, or is not a PipelineSpec; the message says which,
        with the import's own error (a spec module may fail in any way, not only ImportError).
    """
    from spark_apps.eos_stream.spec import SpecError
    from spark_apps.eos_stream.spec import load_spec as load

    try:
        return load(reference)
    except SpecError as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:
        raise ValueError(f"cannot import spec module of {reference!r}: {type(exc).__name__}: {exc}") from None


def load_callable(reference: str) -> Any:
    """The function ``module:ATTRIBUTE`` names (a task callback).

    :raises ValueError: it does not import or is not callable."""
    module_name, _, attribute = reference.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute, None)
    except Exception as exc:
        raise ValueError(f"cannot import {reference!r}: {type(exc).__name__}: {exc}") from None
    if not callable(found):
        raise ValueError(f"{reference!r} is not a function (found {type(found).__name__})")
    return found


def spec_problem(reference: str) -> str | None:
    try:
        load_spec(reference)
    except ValueError as exc:
        return str(exc)
    return None


def target_tables(definition: PipelineDefinition) -> set[str]:
    """``schema.table`` of each table the pipeline's spec writes (empty if the spec does not load)."""
    try:
        spec = load_spec(definition.spec)
    except ValueError:
        return set()
    return {f"{definition.target_schema}.{target.table}" for target in spec.targets}


def shared_places(definitions: Mapping[str, PipelineDefinition]) -> dict[str, list[str]]:
    """Per pipeline, what it shares with another pipeline: a target table, its meta schema (offsets,
    epochs and locks are keyed there) or its checkpoint directory. Each would let one pipeline
    overwrite or fence the other; both pipelines of a pair are named."""
    owners: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, definition in sorted(definitions.items()):
        places = [("meta schema", definition.meta_schema),
                  ("checkpoint directory", definition.checkpoint_dir.rstrip("/"))]
        places += [("target table", table) for table in sorted(target_tables(definition))]
        for place in places:
            owners[place].append(name)
    problems: dict[str, list[str]] = defaultdict(list)
    for (what, where), names in owners.items():
        for name in names if len(names) > 1 else ():
            others = ", ".join(n for n in names if n != name)
            problems[name].append(f"{what} {where} is also pipeline {others}'s")
    return dict(problems)


def definition_problems(definitions: Mapping[str, PipelineDefinition]) -> dict[str, list[str]]:
    """Every problem per pipeline that its own fields do not show: its spec, and the places it
    shares with another pipeline. (Schedules are checked with the fields: ``schedule_problem``.)"""
    problems: dict[str, list[str]] = defaultdict(list)
    for name, definition in definitions.items():
        problem = spec_problem(definition.spec)
        if problem:
            problems[name].append(f"spec: {problem}")
        for key, reference in definition.airflow.callbacks().items():
            try:
                load_callable(reference)
            except ValueError as exc:
                problems[name].append(f"airflow.{key}: {exc}")
    for name, shared in shared_places(definitions).items():
        problems[name] += shared
    return dict(problems)
