"""pyspark and pyspark-client must be one Spark: the rule, and this environment."""

from __future__ import annotations

import pytest

from spark_apps.eos_stream.run.pyspark_pairing import (
    PysparkPairingError,
    check_pyspark_pairing,
    installed_versions,
    pairing_problem,
)


@pytest.mark.parametrize(("versions", "expected"), [
    ({"pyspark": "4.2.0", "pyspark-client": "4.2.0"}, None),
    ({"pyspark": "4.2.0", "pyspark-client": None}, None),  # the full distribution alone is one Spark
    ({"pyspark": "4.2.0", "pyspark-client": "4.1.1"}, "mix of two Sparks"),
    ({"pyspark": None, "pyspark-client": "4.2.0"}, "pip install 'pyspark==4.2.0'"),
    ({"pyspark": None, "pyspark-client": None}, "airflow-provider-eos[spark]"),
])
def test_pairing_rule(versions: dict, expected: str | None) -> None:
    problem = pairing_problem(versions)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem


def test_this_environment_is_one_spark(monkeypatch) -> None:
    assert installed_versions()["pyspark"] is not None
    check_pyspark_pairing()
    from spark_apps.eos_stream.run import pyspark_pairing

    monkeypatch.setattr(pyspark_pairing, "installed_versions", lambda: {"pyspark": "4.2.0", "pyspark-client": "9.9"})
    with pytest.raises(PysparkPairingError, match=r"pyspark 4\.2\.0 and pyspark-client 9\.9"):
        check_pyspark_pairing()


def test_the_spark_extra_pins_pyspark_and_its_client_to_the_connectors_spark() -> None:
    """`pip install airflow-provider-eos[spark]` must not pick a pyspark the Kafka connector jars
    were not built for, nor one beside a pyspark-client of another version: a range of one line is
    not enough (an unconstrained install resolved pyspark 4.2.1 beside pyspark-client 4.2.0, the
    newest client; the pairing check refused it), so both are pinned to the connector's Spark."""
    import configparser
    import re
    from pathlib import Path

    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[2]
    pom = (root / "scripts" / "maven" / "spark-kafka-connector.pom.xml").read_text()
    match = re.search(r"<spark.version>(\d+\.\d+\.\d+)</spark.version>", pom)
    assert match, "the connector's pom names no spark.version"
    spark = match.group(1)
    setup = configparser.ConfigParser()
    setup.read(root / "setup.cfg")
    extra = {Requirement(r).name: Requirement(r).specifier
             for r in setup["options.extras_require"]["spark"].split("\n") if r.strip()}
    for name in ("pyspark", "pyspark-client"):
        assert str(extra[name]) == f"=={spark}", (name, extra[name])
