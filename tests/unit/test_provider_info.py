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
