"""Deployment settings of the provider: where snapshots are kept, where pipeline definitions
live, the default connection ids, how long a restore's replaced tables are kept when
nobody finalized or rolled them back, and where the Spark connector jars and the
PostgreSQL client tools are.

The snapshot store and the definition directory decide where data is read from and
written to, so they come from the deployment, never from a DAG run's conf (anyone
allowed to trigger a DAG could otherwise point a restore at another bucket, or a
snapshot at another directory). Precedence, first one set wins:

1. Airflow's provider config, section ``[eos]`` (``airflow.cfg`` or
   ``AIRFLOW__EOS__SNAPSHOT_STORE`` / ``AIRFLOW__EOS__PIPELINE_CONFIG_DIR``...),
   declared in :func:`airflow_provider_eos.get_provider_info.get_provider_info`;
2. the built-in default, ``Setting.default``: the one definition of each default, which the
   provider info declares too, so ``airflow config get-value eos <option>`` shows it.

The snapshot store has no default: a temporary directory would lose every snapshot on a
reboot, and a default that looks like it works is how that happens. A step that needs
the store refuses to run until the deployment sets one.

No environment variable of the provider's own is read: a DAG file parsed with
these settings reads only Airflow's config.

The DAG factory reads the definition directory and the connection ids when it
parses; the snapshot store and the aside retention are read when a run starts
(its first task pins them), so changing them needs no re-parse and they never
leak into the serialized DAG.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SECTION = "eos"


class SettingsError(ValueError):
    """A run asked for something the deployment does not allow."""


@dataclass(frozen=True)
class Setting:
    key: str
    #: The built-in default; ``None``: none (the option is optional, or required: see ``get``).
    default: str | None
    description: str
    example: str
    type: str = "string"


SNAPSHOT_STORE = Setting(
    key="snapshot_store",
    default=None,
    description="Where snapshots are written and read: a local directory or an object storage URL "
    "(ObjectStoragePath, e.g. s3://aws_conn@bucket/eos; needs the filesystem's package: s3fs, gcsfs "
    "or adlfs). Required by the snapshot and recovery steps: there is no default.",
    example="s3://aws_default@my-bucket/eos-snapshots",
)
PIPELINE_CONFIG_DIR = Setting(
    key="pipeline_config_dir",
    default="/opt/eos/pipelines",
    description="Directory of the pipeline definitions, one <pipeline>.yaml each (no secret: those come "
    "from the connections); the DAG factory builds every pipeline's DAGs from it.",
    example="/opt/eos/pipelines",
)
ASIDE_RETENTION_DAYS = Setting(
    key="aside_retention_days",
    default="7",
    description="Days a restore's aside schema (the tables a restore replaced) is kept when its recovery "
    "was neither finalized nor rolled back; a later successful recovery of the same target drops older "
    "ones.",
    example="14",
    type="float",
)
KAFKA_CONN_ID = Setting(
    key="kafka_conn_id",
    default="kafka_default",
    description="Kafka connection of a pipeline whose definition names none.",
    example="kafka_default",
)
POSTGRES_CONN_ID = Setting(
    key="postgres_conn_id",
    default="eos_postgres",
    description="Postgres connection (the target database) of a pipeline whose definition names none.",
    example="eos_postgres",
)
SPARK_CONN_ID = Setting(
    key="spark_conn_id",
    default="spark_default",
    description="Spark connection (the master spark-submit uses) of a pipeline whose definition names none.",
    example="spark_default",
)
SPARK_JARS = Setting(
    key="spark_jars",
    default=None,
    description="Comma-separated jars spark-submit passes as --jars to the stream and replay apps (Spark's "
    "Kafka connector and its dependencies), on the workers that run them; an operator's jars argument "
    "wins. Unset: none (the cluster or spark.jars.packages provides the connector).",
    example="/opt/spark-jars/spark-sql-kafka-0-10_2.13-4.2.0.jar,/opt/spark-jars/kafka-clients-3.9.2.jar",
)
PG_BIN_DIR = Setting(
    key="pg_bin_dir",
    default=None,
    description="Directory of pg_dump, pg_restore and psql (their major version must be at least the "
    "server's) on the workers that snapshot and restore; an operator's pg_bin_dir argument wins. "
    "Unset: found on PATH.",
    example="/usr/lib/postgresql/16/bin",
)
CONNECTION_SETTINGS = {"kafka": KAFKA_CONN_ID, "postgres": POSTGRES_CONN_ID, "spark": SPARK_CONN_ID}
SETTINGS = (SNAPSHOT_STORE, PIPELINE_CONFIG_DIR, ASIDE_RETENTION_DAYS, *CONNECTION_SETTINGS.values(),
            SPARK_JARS, PG_BIN_DIR)


def env_variable(setting: Setting) -> str:
    """The environment variable Airflow reads for the setting (``AIRFLOW__EOS__<KEY>``)."""
    return f"AIRFLOW__{SECTION.upper()}__{setting.key.upper()}"


def optional(setting: Setting) -> str | None:
    """The setting's value: the provider config, else the built-in default (``None``: unset)."""
    from airflow.configuration import conf

    value = conf.get(SECTION, setting.key, fallback=None)
    return str(value) if value else setting.default


def get(setting: Setting) -> str:
    """The setting's value, which must be set: refused with a message naming the option otherwise."""
    value = optional(setting)
    if value is None:
        raise SettingsError(
            f"[{SECTION}] {setting.key} is not set: set it in airflow.cfg or with the environment variable "
            f"{env_variable(setting)} on every Airflow component ({setting.description})"
        )
    return value


def snapshot_store() -> str:
    return get(SNAPSHOT_STORE)


def spark_jars() -> str | None:
    return optional(SPARK_JARS)


def pg_bin_dir() -> str | None:
    return optional(PG_BIN_DIR)


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


# Keys Airflow's own providers add to a run conf. They say where the run came from, never where it
# reads or writes: with the OpenLineage provider installed, TriggerDagRunOperator (a recovery's
# resume_stream) adds "openlineage" (the parent run's ids), and refusing it would keep the stream down.
PROVIDER_CONF_KEYS = frozenset({"openlineage"})


def check_run_conf(conf: Mapping[str, Any] | None, declared: Iterable[str]) -> None:
    """Refuses a DAG run conf with keys the DAG does not declare as Params (other than
    ``PROVIDER_CONF_KEYS``).

    Airflow merges any conf key into ``params``; an undeclared one would be
    ignored at best, and at worst read by a template, so a conf such as
    ``{"snapshot_store": "/elsewhere"}`` is refused rather than dropped."""
    unknown = sorted(set(conf or {}) - set(declared) - PROVIDER_CONF_KEYS)
    if unknown:
        raise SettingsError(
            f"this DAG does not take {unknown} in its run conf (it takes {sorted(declared)}); what a pipeline reads "
            f"and writes comes from its definition, and the snapshot store from the deployment's [{SECTION}] "
            "provider config"
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
                    # The one definition of the default: Airflow shows it (`airflow config get-value`).
                    "default": s.default,
                }
                for s in SETTINGS
            },
        }
    }
