"""The app's pipeline config, read by recovery steps from a dict or a JSON file.

Kept apart from the snapshot store: a config file is not a snapshot, and the steps that
read one (restore, replay, audit) raise this module's error, not the store's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class PipelineConfigError(ValueError):
    """A pipeline config is missing, unreadable, invalid, or for another pipeline."""


def load_pipeline_config(source: Any, pipeline: str | None = None) -> Any:
    """The pipeline's :class:`spark_apps.eos_stream.run.config.PipelineConfig` from a
    dict or a JSON file path (no password: that comes from the Airflow connection).

    :param pipeline: when given, the config must name this pipeline.
    :raises PipelineConfigError: the file is missing (the message lists the configs
        beside it), unreadable, invalid, or for another pipeline.
    """
    from spark_apps.eos_stream.run.config import ConfigError, from_dict

    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            known = sorted(p.stem for p in path.parent.glob("*.json")) if path.parent.is_dir() else []
            raise PipelineConfigError(
                f"no pipeline config at {path}" + (f"; known pipelines there: {', '.join(known)}" if known else "")
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PipelineConfigError(f"cannot read pipeline config {path}: {exc}") from exc
    elif isinstance(source, dict):
        data = dict(source)
    else:
        raise PipelineConfigError(f"pipeline config must be a dict or a JSON file path, not {type(source).__name__}")
    try:
        config = from_dict(data).validate()
    except (ConfigError, TypeError) as exc:
        raise PipelineConfigError(f"invalid pipeline config: {exc}") from exc
    if pipeline and config.pipeline != pipeline:
        raise PipelineConfigError(f"config is for pipeline {config.pipeline!r}, not {pipeline!r}")
    return config
