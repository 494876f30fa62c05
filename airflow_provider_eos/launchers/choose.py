"""The one choice of a launcher: by the engine that runs (``spark``, ``continuous``, ``direct``)."""

from __future__ import annotations

from airflow_provider_eos.launchers.child_process import ChildProcessLauncher
from airflow_provider_eos.launchers.in_process import InProcessLauncher
from airflow_provider_eos.launchers.protocol import AppLauncher
from airflow_provider_eos.launchers.spark_submit import SparkSubmission, SparkSubmitLauncher

# The engines and how each runs: the Spark app under spark-submit, the continuous engine as a child
# process of this worker, the recovery's direct replay in this process.
ENGINES = ("spark", "continuous", "direct")


def launcher_for(engine: str, spark: SparkSubmission | None = None) -> AppLauncher:
    """The launcher of ``engine``.

    :param spark: how to spark-submit (only ``spark`` reads it; default: the Spark connection's defaults).
    :raises ValueError: an unknown engine.
    """
    if engine == "spark":
        return SparkSubmitLauncher(spark or SparkSubmission())
    if engine == "continuous":
        return ChildProcessLauncher()
    if engine == "direct":
        return InProcessLauncher()
    raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")
