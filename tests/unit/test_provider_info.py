"""get_provider_info: what Airflow's ProvidersManager reads through the entry point."""

from __future__ import annotations

import importlib
import inspect
import json
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.utils import canonicalize_name

import airflow_provider_eos
from airflow_provider_eos.get_provider_info import get_provider_info

DIST = "airflow-provider-eos"
SECTIONS = ("hooks", "operators", "sensors", "triggers")


def _import_dotted(path: str) -> Any:
    """Imports a module path, or a module attribute (a class path)."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as exc:
        module, _, attr = path.rpartition(".")
        if not module or exc.name not in (path,):
            raise
        return getattr(importlib.import_module(module), attr)


def _listed_paths(info: dict[str, Any]) -> list[str]:
    """Every dotted path under hooks/operators/sensors/triggers and connection-types."""
    paths: list[str] = []
    for section in SECTIONS:
        for entry in info.get(section, []):
            if isinstance(entry, str):
                paths.append(entry)
            else:
                paths.extend(entry.get("python-modules", []))
                paths.extend(entry.get("class-names", []))
    paths.extend(c["hook-class-name"] for c in info.get("connection-types", []))
    paths.extend(info.get("hook-class-names", []))
    return paths


def test_package_name_is_the_canonical_distribution_name() -> None:
    dist_name = metadata.distribution(DIST).metadata["Name"]
    assert get_provider_info()["package-name"] == canonicalize_name(dist_name)


def test_version_matches_the_installed_distribution() -> None:
    info = get_provider_info()
    assert info["versions"][0] == airflow_provider_eos.__version__ == metadata.version(DIST)


def test_entry_point_resolves_to_get_provider_info() -> None:
    eps = [ep for ep in metadata.entry_points(group="apache_airflow_provider") if ep.dist.name == DIST]
    assert len(eps) == 1, eps
    assert eps[0].load() is get_provider_info


def test_provider_info_satisfies_airflows_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    import airflow

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(get_provider_info(), schema)


def test_integrations_referenced_by_sections_exist() -> None:
    info = get_provider_info()
    names = {i["integration-name"] for i in info.get("integrations", [])}
    for section in SECTIONS:
        for entry in info.get(section, []):
            if isinstance(entry, dict) and "integration-name" in entry:
                assert entry["integration-name"] in names, (section, entry)


def test_every_listed_path_imports() -> None:
    info = get_provider_info()
    paths = _listed_paths(info)
    for path in paths:
        assert path.startswith("airflow_provider_eos."), path
        _import_dotted(path)  # raises if the module or class is missing


def test_connection_type_hooks_are_classes() -> None:
    for conn in get_provider_info().get("connection-types", []):
        hook = _import_dotted(conn["hook-class-name"])
        assert inspect.isclass(hook), conn
        assert getattr(hook, "conn_type", conn["connection-type"]) == conn["connection-type"], conn


def test_import_dotted_rejects_a_missing_path() -> None:
    # Guards the helper itself: a typo in provider info must not pass silently.
    with pytest.raises((ImportError, AttributeError)):
        _import_dotted("airflow_provider_eos.hooks.no_such_module")
    with pytest.raises(AttributeError):
        _import_dotted("airflow_provider_eos.get_provider_info.NoSuchClass")


# ---------------------------------------------------------------- deployment settings ([eos] provider config)
def test_provider_info_declares_the_eos_config_section() -> None:
    from airflow_provider_eos.utils import provider_config

    section = get_provider_info()["config"][provider_config.SECTION]
    assert set(section["options"]) == {"snapshot_store", "pipeline_config_dir", "aside_retention_days",
                                       "kafka_conn_id", "postgres_conn_id", "spark_conn_id", "spark_jars",
                                       "pg_bin_dir"}
    for option in section["options"].values():
        assert option["type"] in ("string", "float") and option["description"] and option["example"]


def test_provider_info_and_the_code_agree_on_every_default() -> None:
    """One definition per default: what Airflow shows (`airflow config get-value`) is what the code
    falls back to, and no description states a default of its own in prose."""
    from airflow_provider_eos.utils import provider_config

    declared = get_provider_info()["config"][provider_config.SECTION]["options"]
    assert {key: option["default"] for key, option in declared.items()} == {
        s.key: s.default for s in provider_config.SETTINGS}
    for key, option in declared.items():
        assert "default:" not in option["description"].lower(), key
    # Required, with no default at all: a store under /tmp would lose every snapshot on a reboot.
    assert declared["snapshot_store"]["default"] is None


def test_airflow_sees_the_eos_config_section() -> None:
    from airflow.providers_manager import ProvidersManager

    configs = dict(ProvidersManager().provider_configs)
    assert "snapshot_store" in configs[DIST]["eos"]["options"]


@pytest.mark.parametrize(("provider", "expected"), [("/from/provider", "/from/provider"), (None, "default")])
def test_settings_come_from_the_provider_config_else_the_default(monkeypatch, provider, expected) -> None:
    from airflow_provider_eos.utils import provider_config

    for setting in provider_config.SETTINGS:
        variable = provider_config.env_variable(setting)
        assert variable == f"AIRFLOW__EOS__{setting.key.upper()}"
        if provider is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, provider)
        assert provider_config.optional(setting) == (setting.default if expected == "default" else expected)
    assert provider_config.spark_jars() == (None if provider is None else provider)
    assert provider_config.pg_bin_dir() == (None if provider is None else provider)


def test_a_step_needing_the_snapshot_store_refuses_to_run_without_one(monkeypatch) -> None:
    from airflow_provider_eos.utils import provider_config

    monkeypatch.delenv("AIRFLOW__EOS__SNAPSHOT_STORE", raising=False)
    with pytest.raises(provider_config.SettingsError) as refused:
        provider_config.snapshot_store()
    assert "[eos] snapshot_store" in str(refused.value) and "AIRFLOW__EOS__SNAPSHOT_STORE" in str(refused.value)
    monkeypatch.setenv("AIRFLOW__EOS__SNAPSHOT_STORE", "s3://aws_default@bucket/eos")
    assert provider_config.snapshot_store() == "s3://aws_default@bucket/eos"


def test_settings_read_airflow_cfg_and_no_environment_variable_of_their_own(monkeypatch) -> None:
    from airflow.configuration import conf

    from airflow_provider_eos.utils import provider_config

    for variable in ("AIRFLOW__EOS__SNAPSHOT_STORE", "AIRFLOW__EOS__SPARK_JARS", "AIRFLOW__EOS__PG_BIN_DIR"):
        monkeypatch.delenv(variable, raising=False)
    # The provider's own variables of earlier versions: a DAG file must not read them at parse time,
    # nor a worker when it submits or runs pg_dump.
    for variable in ("EOS_SNAPSHOT_STORE", "EOS_PIPELINE_CONFIG_DIR", "EOS_SPARK_JARS", "EOS_PG_BIN_DIR"):
        monkeypatch.setenv(variable, "/from/env")
    if not conf.has_section("eos"):
        conf.add_section("eos")
    conf.set("eos", "snapshot_store", "/from/cfg")
    try:
        assert provider_config.snapshot_store() == "/from/cfg"
    finally:
        conf.remove_option("eos", "snapshot_store")
    with pytest.raises(provider_config.SettingsError, match="snapshot_store"):
        provider_config.snapshot_store()
    assert provider_config.pipeline_config_dir() == provider_config.PIPELINE_CONFIG_DIR.default
    assert provider_config.spark_jars() is None and provider_config.pg_bin_dir() is None


def test_connection_defaults_come_from_the_provider_config(monkeypatch) -> None:
    from airflow_provider_eos.utils import provider_config

    monkeypatch.delenv("AIRFLOW__EOS__POSTGRES_CONN_ID", raising=False)
    monkeypatch.setenv("AIRFLOW__EOS__KAFKA_CONN_ID", "kafka_team_a")
    assert provider_config.connection_defaults() == {"kafka": "kafka_team_a", "postgres": "eos_postgres",
                                              "spark": "spark_default"}


def test_run_conf_with_undeclared_keys_is_refused() -> None:
    from airflow_provider_eos.utils import provider_config

    provider_config.check_run_conf({"pipeline": "ledger"}, ["pipeline", "snapshot"])
    provider_config.check_run_conf(None, ["pipeline"])
    with pytest.raises(provider_config.SettingsError, match="snapshot_store"):
        provider_config.check_run_conf({"pipeline": "ledger", "snapshot_store": "/elsewhere"}, ["pipeline"])
    # The OpenLineage provider's parent-run link, which TriggerDagRunOperator adds (a recovery's resume).
    provider_config.check_run_conf({"openlineage": {"parentRunId": "0190a4f2-0000-7000-8000-000000000000"}}, [])


def test_aside_retention_days_is_a_non_negative_number(monkeypatch) -> None:
    from airflow_provider_eos.utils import provider_config

    monkeypatch.delenv("AIRFLOW__EOS__ASIDE_RETENTION_DAYS", raising=False)
    assert provider_config.aside_retention_days() == 7.0
    monkeypatch.setenv("AIRFLOW__EOS__ASIDE_RETENTION_DAYS", "0.5")
    assert provider_config.aside_retention_days() == 0.5
    for bad in ("soon", "-1"):
        monkeypatch.setenv("AIRFLOW__EOS__ASIDE_RETENTION_DAYS", bad)
        with pytest.raises(provider_config.SettingsError):
            provider_config.aside_retention_days()
