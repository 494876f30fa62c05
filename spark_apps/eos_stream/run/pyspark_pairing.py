"""pyspark and pyspark-client must be one Spark.

Both distributions install into the same ``pyspark`` import package: pyspark-client (which
the Airflow Spark provider depends on) is the Spark Connect client, pyspark the full
distribution with spark-submit and the jars. Installed at different versions, the files of
one overwrite some of the other's, and a job runs on a mix of two Sparks. Nothing pins them
together, so this check refuses the mix with a message that says what to install.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata

DISTRIBUTIONS = ("pyspark", "pyspark-client")


class PysparkPairingError(RuntimeError):
    """pyspark is missing or does not match pyspark-client."""


def installed_versions() -> dict[str, str | None]:
    """The installed version of each distribution, None when it is not installed."""
    found: dict[str, str | None] = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def pairing_problem(versions: Mapping[str, str | None]) -> str | None:
    """What is wrong with these versions for running the app, or None when they are one Spark."""
    full, client = versions.get("pyspark"), versions.get("pyspark-client")
    if full is None:
        hint = f"pip install 'pyspark=={client}'" if client else "pip install 'airflow-provider-eos[spark]'"
        return f"pyspark (the Spark distribution with spark-submit) is not installed: {hint}"
    if client is not None and client != full:
        return (f"pyspark {full} and pyspark-client {client} are installed together; both write the `pyspark` "
                f"package, so a job would run on a mix of two Sparks. Install one version of both, e.g. "
                f"pip install 'pyspark=={client}' 'pyspark-client=={client}'")
    return None


def check_pyspark_pairing() -> None:
    """Raises :class:`PysparkPairingError` unless pyspark is installed and matches pyspark-client."""
    problem = pairing_problem(installed_versions())
    if problem:
        raise PysparkPairingError(problem)
