"""What the submit hook ships to executors on other hosts."""

from __future__ import annotations

import zipfile

from airflow_provider_eos.hooks.stream_submit import build_spark_apps_zip, spec_package_files


def test_the_teams_whole_top_level_package_travels(tmp_path, monkeypatch) -> None:
    (tmp_path / "team" / "acme_t1" / "specs" / "__pycache__").mkdir(parents=True)
    for name in ("acme_t1/__init__.py", "acme_t1/naming.py", "acme_t1/specs/__init__.py",
                 "acme_t1/specs/orders.py", "acme_t1/specs/columns.yaml", "acme_t1/specs/__pycache__/x.pyc"):
        (tmp_path / "team" / name).write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "team"))
    names = [name for _file, name in spec_package_files("acme_t1.specs.orders:ORDERS")]
    assert sorted(names) == ["acme_t1/__init__.py", "acme_t1/naming.py", "acme_t1/specs/__init__.py",
                             "acme_t1/specs/columns.yaml", "acme_t1/specs/orders.py"]
    with zipfile.ZipFile(build_spark_apps_zip(tmp_path, "acme_t1.specs.orders:ORDERS")) as archive:
        shipped = archive.namelist()
    assert "acme_t1/specs/orders.py" in shipped and "spark_apps/eos_stream/app.py" in shipped


def test_a_single_module_travels_as_itself(tmp_path, monkeypatch) -> None:
    (tmp_path / "acme_single.py").write_text("SPEC = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [name for _f, name in spec_package_files("acme_single:SPEC")] == ["acme_single.py"]


def test_nothing_extra_for_the_projects_own_specs_or_what_is_not_here() -> None:
    assert spec_package_files("spark_apps.ledger.spec:LEDGER") == []
    # Not importable on this worker: it must be installed on the cluster (docs/deployment.md).
    assert spec_package_files("nowhere_to_be_found.specs:X") == []
    assert spec_package_files(None) == []
