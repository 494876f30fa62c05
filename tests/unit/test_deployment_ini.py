"""The ``[eos]`` block of docs/deployment.md works when copied into ``airflow.cfg``: read by
Airflow's own config parser, every option the provider declares is there, and every value is
what it looks like. Airflow's parser keeps an inline ``# comment`` as part of the value (it
sets no ``inline_comment_prefixes``), so a comment there would become part of a path."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import pytest

from airflow_provider_eos.utils import provider_config

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR_POM = ROOT / "scripts" / "maven" / "spark-kafka-connector.pom.xml"
CONN_ID = re.compile(r"[A-Za-z0-9_.-]+")


def _documented_block() -> str:
    text = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
    found = re.search(r"```ini\n(\[eos\]\n.*?)```", text, re.DOTALL)
    assert found, "docs/deployment.md shows the [eos] block as an ini block"
    return found.group(1)


def _connector_jars() -> set[str]:
    """The jar files of Spark's Kafka source, as the POM that resolves them names them (the
    PostgreSQL JDBC driver there is the benchmarks' ``df.write.jdbc`` peer's, not the app's)."""
    pom = CONNECTOR_POM.read_text(encoding="utf-8")
    versions = dict(re.findall(r"<([\w.-]+)\.version>([^<]+)<", pom))
    jars = set()
    for artifact, version in re.findall(r"<artifactId>([^<]+)</artifactId>\s*<version>\$\{([^}]+)\}", pom):
        if artifact != "postgresql":
            jars.add(f"{artifact}-{versions[version.removesuffix('.version')]}.jar")
    return jars


def _value_problem(key: str, value: str, parser: object) -> str | None:
    """What is wrong with one documented value (None: nothing)."""
    if "#" in value or any(c.isspace() for c in value):
        return f"{key} = {value!r}: a comment or a space became part of the value"
    if key in ("pipeline_config_dir", "pg_bin_dir") and not PurePosixPath(value).is_absolute():
        return f"{key} = {value!r} is no absolute directory"
    if key == "snapshot_store" and not (urlparse(value).scheme and urlparse(value).netloc):
        return f"{key} = {value!r} is no object storage URL"
    if key == "aside_retention_days" and parser.getfloat("eos", key) < 0:  # type: ignore[attr-defined]
        return f"{key} = {value!r} is no number of days"
    if key.endswith("_conn_id") and not CONN_ID.fullmatch(value):
        return f"{key} = {value!r} is no connection id"
    if key == "spark_jars":
        jars = value.split(",")
        if not all(PurePosixPath(j).is_absolute() and j.endswith(".jar") for j in jars):
            return f"{key} = {value!r}: not a comma-separated list of jar paths"
        if {PurePosixPath(j).name for j in jars} != _connector_jars():
            return f"{key} names {sorted(PurePosixPath(j).name for j in jars)}, not {sorted(_connector_jars())}"
    return None


def ini_problems(block: str) -> list[str]:
    """What Airflow's config parser makes of ``block`` that a deployment would not want."""
    from airflow.configuration import AirflowConfigParser

    parser = AirflowConfigParser()
    parser.read_string(block)
    options = dict(parser.items("eos", raw=True)) if parser.has_section("eos") else {}
    declared = {s.key for s in provider_config.SETTINGS}
    problems = [f"{sorted(declared - set(options))} missing" if declared - set(options) else "",
                f"{sorted(set(options) - declared)} are no [eos] options" if set(options) - declared else ""]
    problems += [_value_problem(key, parser.get("eos", key), parser) or "" for key in sorted(options)]
    return [p for p in problems if p]


@pytest.fixture(autouse=True)
def _no_eos_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # AIRFLOW__EOS__* would win over the block's values in Airflow's parser.
    for setting in provider_config.SETTINGS:
        monkeypatch.delenv(provider_config.env_variable(setting), raising=False)


def test_the_documented_block_loads_as_written() -> None:
    assert ini_problems(_documented_block()) == []


def test_the_connector_jars_are_the_four_the_docs_name() -> None:
    assert _connector_jars() == {"spark-sql-kafka-0-10_2.13-4.2.0.jar", "kafka-clients-3.9.2.jar",
                                 "spark-token-provider-kafka-0-10_2.13-4.0.0.jar", "commons-pool2-2.13.1.jar"}


@pytest.mark.parametrize(("line", "why"), [
    ("pipeline_config_dir = /opt/airflow/eos-pipelines   # one <name>.yaml per pipeline", "comment"),
    ("snapshot_store = /var/eos", "URL"),
    ("aside_retention_days = -1", "days"),
    ("spark_jars = /opt/spark-jars/spark-sql-kafka-0-10_2.13-4.2.0.jar,...", "jar paths"),
    ("kafka_conn_id = kafka default", "space"),
])
def test_a_broken_value_is_found(line: str, why: str) -> None:
    block = _documented_block()
    key = line.split(" = ")[0]
    broken = re.sub(rf"^{key} = .*$", line, block, flags=re.MULTILINE)
    problems = ini_problems(broken)
    assert len(problems) == 1 and why in problems[0], problems


def test_a_missing_option_is_found() -> None:
    block = re.sub(r"^pg_bin_dir = .*\n", "", _documented_block(), flags=re.MULTILINE)
    assert ini_problems(block) == ["['pg_bin_dir'] missing"]
