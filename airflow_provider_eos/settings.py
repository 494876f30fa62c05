"""Deployment settings of the provider: where snapshots are kept, where pipeline configs live,
and how long a restore's replaced tables are kept when nobody finalized or rolled them back.

The first two decide where data is read from and written to, so they come from the
deployment, never from a DAG run's conf (anyone allowed to trigger a DAG could
otherwise point a restore at another bucket, or a snapshot at another
directory). Precedence, first one set wins:

1. Airflow's provider config, section ``[eos]`` (``airflow.cfg`` or
   ``AIRFLOW__EOS__SNAPSHOT_STORE`` / ``AIRFLOW__EOS__PIPELINE_CONFIG_DIR``),
   declared in :func:`airflow_provider_eos.get_provider_info.get_provider_info`;
2. the environment variables (``EOS_SNAPSHOT_STORE``, ``EOS_PIPELINE_CONFIG_DIR``,
   ``EOS_ASIDE_RETENTION_DAYS``);
3. the built-in default.

Read at execute time (the DAG's first task pins them for the run), so a
changed deployment setting never needs a DAG file re-parse and never leaks
into the serialized DAG.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spark_apps.eos_stream.config import PIPELINE_NAME

SECTION = "eos"
# A pipeline name becomes a file name (<dir>/<pipeline>.json) and a store directory:
# the leading letter or digit rules out ".", ".." and hidden names, the class rules out "/".
# One definition, the app's; anchored here for JSON Schema (a DAG Param's "pattern").
PIPELINE_NAME_PATTERN = f"^{PIPELINE_NAME.pattern}$"


class SettingsError(ValueError):
    """A run asked for something the deployment does not allow."""


@dataclass(frozen=True)
class Setting:
    key: str
    env: str  # "" when no environment variable falls back for it
    default: str
    description: str
    example: str
    type: str = "string"


SNAPSHOT_STORE = Setting(
    key="snapshot_store",
    env="EOS_SNAPSHOT_STORE",
    default="/tmp/eos-snapshots",
    description="Where snapshots are written and read: a local directory or an object storage URL "
    "(ObjectStoragePath, e.g. s3://aws_conn@bucket/eos). Falls back to the EOS_SNAPSHOT_STORE "
    "environment variable, then /tmp/eos-snapshots.",
    example="s3://aws_default@my-bucket/eos-snapshots",
)
PIPELINE_CONFIG_DIR = Setting(
    key="pipeline_config_dir",
    env="EOS_PIPELINE_CONFIG_DIR",
    default="/opt/eos/pipelines",
    description="Directory of the pipelines' JSON configs, one <pipeline>.json each (no password: that "
    "comes from the postgres connection). Falls back to the EOS_PIPELINE_CONFIG_DIR environment "
    "variable, then /opt/eos/pipelines.",
    example="/opt/eos/pipelines",
)
ASIDE_RETENTION_DAYS = Setting(
    key="aside_retention_days",
    env="EOS_ASIDE_RETENTION_DAYS",
    default="7",
    description="Days a restore's aside schema (the tables a restore replaced) is kept when its recovery "
    "was neither finalized nor rolled back; a later successful recovery of the same target drops older "
    "ones. Falls back to the EOS_ASIDE_RETENTION_DAYS environment variable, then 7.",
    example="14",
    type="float",
)
KAFKA_CONN_ID = Setting(
    key="kafka_conn_id",
    env="",
    default="kafka_default",
    description="Kafka connection of a pipeline whose definition names none.",
    example="kafka_default",
)
POSTGRES_CONN_ID = Setting(
    key="postgres_conn_id",
    env="",
    default="eos_postgres",
    description="Postgres connection (the target database) of a pipeline whose definition names none.",
    example="eos_postgres",
)
SPARK_CONN_ID = Setting(
    key="spark_conn_id",
    env="",
    default="spark_default",
    description="Spark connection (the master spark-submit uses) of a pipeline whose definition names none.",
    example="spark_default",
)
CONNECTION_SETTINGS = {"kafka": KAFKA_CONN_ID, "postgres": POSTGRES_CONN_ID, "spark": SPARK_CONN_ID}
SETTINGS = (SNAPSHOT_STORE, PIPELINE_CONFIG_DIR, ASIDE_RETENTION_DAYS, *CONNECTION_SETTINGS.values())


def get(setting: Setting, environ: Mapping[str, str] | None = None) -> str:
    """The setting's value by the precedence above."""
    from airflow.configuration import conf

    value = conf.get(SECTION, setting.key, fallback=None)
    if value:
        return str(value)
    if not setting.env:
        return setting.default
    env = os.environ if environ is None else environ
    return env.get(setting.env) or setting.default


def snapshot_store() -> str:
    return get(SNAPSHOT_STORE)


def pipeline_config_dir() -> str:
    return get(PIPELINE_CONFIG_DIR)


def connection_defaults() -> dict[str, str]:
    """The deployment's default connection ids, by role (kafka, postgres, spark)."""
    return {role: get(setting) for role, setting in CONNECTION_SETTINGS.items()}


def aside_retention_days() -> float:
    value = get(ASIDE_RETENTION_DAYS)
    try:
        days = float(value)
    except ValueError:
        raise SettingsError(f"[{SECTION}] {ASIDE_RETENTION_DAYS.key} must be a number of days, not {value!r}") from None
    if days < 0:
        raise SettingsError(f"[{SECTION}] {ASIDE_RETENTION_DAYS.key} must be 0 or more, not {value!r}")
    return days


def check_pipeline_name(name: Any) -> str:
    """``name`` when it is a valid pipeline name, else :class:`SettingsError`."""
    if not isinstance(name, str) or not PIPELINE_NAME.fullmatch(name):
        raise SettingsError(f"invalid pipeline name {name!r}: it must match {PIPELINE_NAME_PATTERN}")
    return name


def pipeline_config_path(pipeline: str, config_dir: str | None = None) -> Path:
    """``<pipeline_config_dir>/<pipeline>.json`` for a valid name; never a path outside that directory."""
    # The name has no "/" and does not start with ".", so the file is always directly in the directory.
    return Path(config_dir or pipeline_config_dir()) / f"{check_pipeline_name(pipeline)}.json"


def check_run_conf(conf: Mapping[str, Any] | None, declared: Iterable[str]) -> None:
    """Refuses a DAG run conf with keys the DAG does not declare as Params.

    Airflow merges any conf key into ``params``; an undeclared one would be
    ignored at best, and at worst read by a template, so a conf such as
    ``{"snapshot_store": "/elsewhere"}`` is refused rather than dropped."""
    unknown = sorted(set(conf or {}) - set(declared))
    if unknown:
        raise SettingsError(
            f"this DAG does not take {unknown} in its run conf (it takes {sorted(declared)}); the snapshot store "
            f"and the pipeline config directory come from the deployment's [{SECTION}] provider config"
        )


def provider_config() -> dict[str, Any]:
    """The ``config`` entry of the provider info (Airflow's provider config format)."""
    return {
        SECTION: {
            "description": "Deployment settings of the exactly-once streaming provider. They decide where "
            "snapshots and pipeline configs are read and written, so DAG run conf cannot override them.",
            "options": {
                s.key: {
                    "description": s.description,
                    "version_added": "0.1.0",
                    "type": s.type,
                    "example": s.example,
                    # No default here: the environment variable and the built-in default come after it.
                    "default": None,
                }
                for s in SETTINGS
            },
        }
    }
