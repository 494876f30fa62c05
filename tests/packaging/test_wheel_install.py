"""The built wheel installs with its `spark` extra into a fresh Airflow 3 virtualenv without
constraints.txt, registers the provider and its [eos] config with their defaults, its DAG factory
builds a pipeline's DAGs there, and the app's pyspark pairing check passes.

A fresh virtualenv (no system site-packages) gets `airflow-provider-eos[spark]` from the built wheel,
every version resolved from the package index by uv, Airflow included: the documented install of
a worker that runs Spark (an unconstrained install once picked pyspark 4.2.1 beside pyspark-client
4.2.0, and the app refused to start). The components that never run Spark install without the extra;
the wheel's metadata shows they get no pyspark. uv's cache lives in the stack's state directory
(.local) so that reruns are quick: about a minute with a warm cache on 2 cores, three on a cold one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.conftest import STATE_DIR

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
from airflow.configuration import conf
from spark_apps.eos_stream.run.pyspark_pairing import check_pyspark_pairing
dags = pipeline_dags(sys.argv[1])
check_pyspark_pairing()  # raises unless pyspark and pyspark-client are one Spark
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
    "pyspark-client": installed("pyspark-client"),
    "pipeline_config_dir": conf.get("eos", "pipeline_config_dir"),
}))
"""


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command[:3]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _airflow_floor() -> str:
    """The oldest Airflow the package declares (setup.cfg's ``apache-airflow>=X.Y``), as X.Y.0."""
    found = re.search(r"apache-airflow>=([0-9]+\.[0-9]+)(?:\.([0-9]+))?", (ROOT / "setup.cfg").read_text())
    assert found, "setup.cfg declares no apache-airflow>= floor"
    return f"{found.group(1)}.{found.group(2) or 0}"


# The newest Airflow the package index has, and the oldest the package declares: the floor is a
# promise only if a fresh install of it also registers the provider and builds the DAGs.
@pytest.mark.parametrize("airflow", ["newest", "floor"])
def test_the_wheel_installs_into_a_fresh_airflow_without_constraints(tmp_path: Path, airflow: str) -> None:
    started = time.monotonic()
    wheels = tmp_path / "wheels"
    env = {**os.environ, "UV_CACHE_DIR": str(STATE_DIR / "uv-cache")}
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
    [metadata_name] = [name for name in names if name.endswith(".dist-info/METADATA")]
    requires = zipfile.ZipFile(wheel).read(metadata_name).decode().splitlines()
    assert "Requires-Python: >=3.10" in requires
    spark_only = {line.split(":", 1)[1].split(";")[0].strip() for line in requires
                  if line.startswith("Requires-Dist:") and "extra == \"spark\"" in line}
    pins = {name: version for name, _, version in (r.partition("==") for r in spark_only)
            if name in ("pyspark", "pyspark-client")}
    assert len(pins) == 2 and len(set(pins.values())) == 1, spark_only  # one Spark, pinned
    # Without the extra, nothing requires pyspark (the Spark provider's pyspark-client is the Connect client).
    assert not any(line.startswith("Requires-Dist: pyspark") and "extra ==" not in line for line in requires)
    built = time.monotonic() - started

    venv = tmp_path / "venv"
    _run([str(UV), "venv", "-q", "--python", sys.executable, str(venv)], env=env, timeout=120)
    python = venv / "bin" / "python"
    # No constraints, no pins of ours: uv resolves the extra's pins together with Airflow's and the
    # Spark provider's own requirements (pyspark-client among them).
    pinned = [f"apache-airflow=={_airflow_floor()}"] if airflow == "floor" else []
    _run([str(UV), "pip", "install", "-q", "--python", str(python), f"{wheel}[spark]", *pinned], env=env, timeout=600)
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
    print(f"\nwheel built in {built:.1f}s, installed with [spark] in {installed:.1f}s (uv, no constraints): {report}")
    assert report["provider"] and report["airflow"].startswith("3.")
    if airflow == "floor":
        assert report["airflow"] == _airflow_floor(), report
    assert {"snapshot_store", "pipeline_config_dir", "kafka_conn_id", "spark_jars"} <= set(report["eos_config"])
    assert report["pipeline_config_dir"] == "/opt/eos/pipelines"  # the declared default, seen by Airflow
    assert report["dags"] == sorted(f"eos_{kind}__shop" for kind in ("health", "recovery", "snapshot", "stop",
                                                                      "stream"))
    # The pairing check passed above, on the extra's Spark (test_pyspark_pairing ties it to the connector's).
    assert report["pyspark"] == report["pyspark-client"] == pins["pyspark"], report
