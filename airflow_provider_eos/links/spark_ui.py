"""The stream task's link to its running Spark driver's UI.

The driver's UI listens on a port the OS picks (``spark.ui.port=0``, set by the
submit hook), so two pipelines never collide; the app prints the URL as an
``EOS-UI`` line and the supervising operator stores it in this link's XCom as
soon as it appears, so the link works while the task runs. When the task ends,
Airflow stores :meth:`get_link` once more: the last driver's URL, which no longer
answers once that driver has exited (a Spark history server keeps finished
applications).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperatorLink


class SparkDriverUILink(BaseOperatorLink):
    """"Spark driver UI": the URL the running driver reported (jobs, stages and the
    Structured Streaming tab with each micro-batch's rates and durations)."""

    name = "Spark driver UI"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        # Called on the worker when the task ends; the API server reads the XCom instead.
        return getattr(operator, "spark_ui_url", None) or ""
