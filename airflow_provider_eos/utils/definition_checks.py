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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spark_apps.eos_stream.run.config_rules import refusals

if TYPE_CHECKING:
    from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition

def load_spec(pipeline: Any) -> Any:
    """The PipelineSpec of a definition or an app config (the app's own ``spec.spec_of``): the one
    its ``mirror`` section builds, or the one its ``spec`` names; or the one a ``module:ATTRIBUTE``
    string names.

    :raises ValueError: it does not import, or is not a PipelineSpec; the message says which,
        with the import's own error (a spec module may fail in any way, not only ImportError).
    """
    from spark_apps.eos_stream.records.spec import SpecError, SpecSource

    source = SpecSource(reference=pipeline) if isinstance(pipeline, str) else SpecSource.of(pipeline)
    try:
        return source.load()
    except SpecError as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:
        what = (f"cannot import spec module of {source.reference!r}" if source.reference
                else "cannot read the mirror section")
        raise ValueError(f"{what}: {type(exc).__name__}: {exc}") from None


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


def target_tables(definition: PipelineDefinition) -> set[str]:
    """``schema.table`` of each table the pipeline's spec writes (empty if the spec does not load)."""
    try:
        spec = load_spec(definition)
    except ValueError:
        return set()
    return {f"{definition.target_schema}.{table}" for table in spec.target_tables()}


# What a newcomer sets to stop sharing each kind of place.
_OWN_SETTING = {"target table": "target_schema", "meta schema": "meta_schema",
                "checkpoint directory": "checkpoint_dir"}


def shared_places(definitions: Mapping[str, PipelineDefinition],
                  seniority: Sequence[str] | None = None) -> dict[str, list[str]]:
    """Per pipeline, what it claims that an older pipeline already owns: a target table, its meta
    schema (offsets, epochs and locks are keyed there) or its checkpoint directory. Each would let
    one pipeline overwrite or fence the other.

    Only the newcomer is refused: the owner of a place is the first of the pipelines claiming it
    in ``seniority`` (oldest first; ``load_definitions`` ranks by the age of the definition file,
    see there), so a team that adds a clashing file never takes a running pipeline's DAGs away.

    :param seniority: every pipeline's name, oldest first (default: by name)."""
    order = {name: index for index, name in enumerate(seniority or sorted(definitions))}
    claims: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, definition in sorted(definitions.items(), key=lambda item: (order.get(item[0], len(order)), item[0])):
        places = [("meta schema", definition.meta_schema),
                  ("checkpoint directory", definition.checkpoint_dir.rstrip("/"))]
        places += [("target table", table) for table in sorted(target_tables(definition))]
        for place in places:
            claims[place].append(name)
    taken: dict[tuple[str, str, str], list[str]] = defaultdict(list)  # (newcomer, what, owner) -> places
    for (what, where), (owner, *newcomers) in claims.items():
        for name in newcomers:
            taken[(name, what, owner)].append(where)
    problems: dict[str, list[str]] = defaultdict(list)
    for (name, what, owner), wheres in taken.items():
        problems[name].append(f"{what}{'s' if len(wheres) > 1 else ''} {', '.join(wheres)} "
                              f"{'belong' if len(wheres) > 1 else 'belongs'} to pipeline {owner!r} (its definition "
                              f"is the older); give this pipeline its own {_OWN_SETTING[what]}")
    return dict(problems)


def definition_problems(definitions: Mapping[str, PipelineDefinition],
                        seniority: Sequence[str] | None = None) -> dict[str, list[str]]:
    """Every problem per pipeline that its own fields do not show: what the app would refuse with
    its spec loaded (``config_rules.refusals``), its callbacks, and the places it shares with
    another pipeline. (Schedules are checked with the fields: ``schedule_problem``.)"""
    problems: dict[str, list[str]] = defaultdict(list)
    for name, definition in definitions.items():
        # What the app's start would refuse from this config alone (the app's own list).
        for refusal in refusals(definition.app_pipeline_config()):
            problems[name].append(f"spec: {refusal.message}" if refusal.rule == "spec" else refusal.message)
        for key, reference in definition.airflow.callbacks().items():
            try:
                load_callable(reference)
            except ValueError as exc:
                problems[name].append(f"airflow.{key}: {exc}")
    for name, shared in shared_places(definitions, seniority).items():
        problems[name] += shared
    return dict(problems)
