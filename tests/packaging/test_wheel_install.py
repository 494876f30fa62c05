"""The built wheel installs into a fresh Airflow 3 virtualenv without constraints.txt, registers the
provider and its [eos] config, and its DAG factory builds a pipeline's DAGs there.

A fresh virtualenv (no system site-packages) gets the wheel with its own version ranges resolved
from the package index by uv, without the `spark` extra: what a scheduler, dag-processor or
triggerer needs, which never run Spark. uv's cache lives under .local so that reruns are quick."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).with_name("uv")
pytestmark = [pytest.mark.packaging, pytest.mark.timeout(900)]

CHECK = """
import json, sys
from pathlib import Path
from airflow.providers_manager import ProvidersManager
from importlib import metadata

manager = ProvidersManager()
info = manager.providers.get("airflow-provider-eos")
configs = dict(manager.provider_configs)
from airflow_provider_eos.dag_factory import pipeline_dags
dags = pipeline_dags(sys.argv[1])
def installed(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
print("RESULT " + json.dumps({
    "provider": info.version if info else None,
    "eos_config": sorted(configs.get("airflow-provider-eos", {}).get("eos", {}).get("options", {})),
    "dags": sorted(dags),
    "airflow": installed("apache-airflow"),
    "pyspark": installed("pyspark"),
}))
"""


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command[:3]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_the_wheel_installs_into_a_fresh_airflow_without_constraints(tmp_path: Path) -> None:
    started = time.monotonic()
    wheels = tmp_path / "wheels"
    env = {**os.environ, "UV_CACHE_DIR": str(ROOT / ".local" / "uv-cache")}
    _run([str(UV), "build", "-q", "--wheel", "-o", str(wheels), str(ROOT)], cwd=tmp_path, env=env, timeout=300)
    [wheel] = wheels.glob("airflow_provider_eos-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("airflow_provider_eos/dag_factory/__init__.py", "airflow_provider_eos/utils/pipeline_definition.py",
                   "spark_apps/eos_stream/app.py", "spark_apps/orders/spec.py"):
        assert module in names, f"{module} is not in the wheel"
    assert not any(name.startswith(("tests/", "dags/")) for name in names)
    for marker in ("airflow_provider_eos/py.typed", "spark_apps/py.typed"):
        assert marker in names, f"{marker} is not in the wheel: type checkers would ignore the package's hints"
    assert any(name.endswith("/LICENSE") and ".dist-info/" in name for name in names), names
    built = time.monotonic() - started

    venv = tmp_path / "venv"
    _run([str(UV), "venv", "-q", "--python", sys.executable, str(venv)], env=env, timeout=120)
    python = venv / "bin" / "python"
    _run([str(UV), "pip", "install", "-q", "--python", str(python), str(wheel)], env=env, timeout=600)
    installed = time.monotonic() - started - built

    definitions = tmp_path / "pipelines"
    definitions.mkdir()
    (definitions / "shop.yaml").write_text(json.dumps({
        "name": "shop", "topics": ["shop.events"], "spec": "spark_apps.orders.spec:ORDERS",
        "target_schema": "shop", "meta_schema": "shop_eos", "checkpoint_dir": "/tmp/shop"}))
    clean_env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "AIRFLOW_HOME": str(tmp_path / "airflow"),
                 "HOME": str(tmp_path)}
    result = _run([str(python), "-c", CHECK, str(definitions)], env=clean_env, cwd=tmp_path, timeout=300)
    line = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")][-1]
    report = json.loads(line[len("RESULT "):])
    print(f"\nwheel built in {built:.1f}s, installed in {installed:.1f}s (uv, no constraints): {report}")
    assert report["provider"] and report["airflow"].startswith("3.")
    assert {"snapshot_store", "pipeline_config_dir", "kafka_conn_id"} <= set(report["eos_config"])
    assert report["dags"] == sorted(f"eos_{kind}__shop" for kind in ("health", "recovery", "snapshot", "stop",
                                                                      "stream"))
    assert report["pyspark"] is None  # the components that never run Spark do without it
