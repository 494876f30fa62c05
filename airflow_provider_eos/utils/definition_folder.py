"""The folder of pipeline definitions (``[eos] pipeline_config_dir``): one file per pipeline,
named after it. Loading the folder checks each definition on its own
(:mod:`.pipeline_definition`) and all of them together (:mod:`.definition_checks`).

Nothing here imports Airflow."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from airflow_provider_eos.utils.definition_checks import definition_problems
from airflow_provider_eos.utils.pipeline_definition import (
    PipelineDefinition,
    PipelineDefinitionError,
    load_definition,
)
from spark_apps.eos_stream.run.config_rules import PIPELINE_NAME

SUFFIXES = (".yaml", ".yml", ".json")
# What to do about a missing directory that the deployment's config named; a command that was
# given the directory says its own (``cli``).
FIX_THE_CONFIG = "set [eos] pipeline_config_dir to the directory of your <pipeline>.yaml files"
# What to do about a definition directory the command line named and that does not exist.
FIX_THE_ARGUMENT = "name the directory that holds your <pipeline>.yaml files"


def definitions_root(directory: str | None) -> tuple[str, str]:
    """The definition directory a command reads (``--dir``, else ``[eos] pipeline_config_dir``)
    and what to do if it does not exist: the hint names where the directory came from."""
    from airflow_provider_eos.utils import provider_config

    if directory:
        return directory, FIX_THE_ARGUMENT
    return provider_config.pipeline_config_dir(), f"{FIX_THE_CONFIG}, or give --dir"


def definition_files(directory: str | Path, fix: str = FIX_THE_CONFIG) -> list[Path]:
    """The definition files in ``directory`` (not hidden, not in subdirectories), sorted.

    :param fix: what the error of a missing directory tells the user to do."""
    root = Path(directory)
    if not root.is_dir():
        raise PipelineDefinitionError(f"the pipeline definition directory {root} does not exist: {fix}")
    return sorted(p for p in root.iterdir()
                  if p.suffix in SUFFIXES and p.is_file() and not p.name.startswith("."))


def load_definitions(directory: str | Path,
                     fix: str = FIX_THE_CONFIG) -> tuple[dict[str, PipelineDefinition], dict[str, str]]:
    """Every pipeline in ``directory``: (valid definitions by name, error by file name); ``fix``
    as ``definition_files``'.

    One bad file never hides the others: each pipeline is independent, and its team sees its
    own error. Two files for one name (``a.yaml`` and ``a.json``) are both refused, and so is
    what the app's start would refuse (``config_rules``, the spec imported) and a pipeline that
    claims a target table, a meta schema or a checkpoint directory an older one owns
    (``definition_checks.shared_places``, ``seniority``): the older keeps its DAGs."""
    found: dict[str, PipelineDefinition] = {}
    paths: dict[str, Path] = {}
    errors: dict[str, str] = {}
    files = definition_files(directory, fix)
    stems = [p.stem for p in files]
    for path in files:
        if stems.count(path.stem) > 1:
            errors[path.name] = f"{path}: more than one definition file for pipeline {path.stem!r}"
            continue
        try:
            found[path.stem] = load_definition(path)
            paths[path.stem] = path
        except PipelineDefinitionError as exc:
            errors[path.name] = str(exc)
    for name, problems in definition_problems(found, seniority(paths)).items():
        errors[paths[name].name] = f"{paths[name]}: invalid pipeline definition: {'; '.join(problems)}"
        del found[name]
    return found, errors


def seniority(paths: Mapping[str, Path]) -> list[str]:
    """The pipelines oldest first: by their definition file's modification time in whole seconds,
    then by file name. The older one owns what two claim (``definition_checks.shared_places``), so
    a file added later never takes a running pipeline's place. A deployment that writes every file
    at once (a fresh git-sync worktree, an image build) gives them one time: then the name decides."""
    return sorted(paths, key=lambda name: (int(paths[name].stat().st_mtime), paths[name].name))


def find_definition(directory: str | Path, name: str, fix: str = FIX_THE_CONFIG) -> PipelineDefinition:
    """The one pipeline called ``name``; the error lists the pipelines that do exist (``fix`` as
    ``definition_files``')."""
    if not PIPELINE_NAME.fullmatch(name):
        raise PipelineDefinitionError(f"invalid pipeline name {name!r}")
    candidates = [Path(directory) / f"{name}{suffix}" for suffix in SUFFIXES]
    present = [p for p in candidates if p.is_file()]
    if len(present) == 1:
        return load_definition(present[0])
    if present:
        raise PipelineDefinitionError(f"more than one definition file for pipeline {name!r}: "
                                      f"{', '.join(str(p) for p in present)}")
    known = sorted({p.stem for p in definition_files(directory, fix)})
    raise PipelineDefinitionError(f"no pipeline {name!r} in {directory}"
                                  + (f"; defined there: {', '.join(known)}" if known else ""))
