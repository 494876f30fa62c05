"""airflow_provider_eos.utils loads without Airflow, as its docstring says."""

from __future__ import annotations

import subprocess
import sys

from tests.streaming import ROOT

CHECK = """
import importlib, pkgutil, sys

class NoAirflow:
    def find_spec(self, name, path=None, target=None):
        if name == "airflow" or name.startswith("airflow."):
            raise ImportError(f"{name} imported")

sys.meta_path.insert(0, NoAirflow())
import airflow_provider_eos.utils as utils
names = [m.name for m in pkgutil.iter_modules(utils.__path__)]
for name in names:
    importlib.import_module(f"airflow_provider_eos.utils.{name}")
print(len(names))
"""


def test_every_utils_module_imports_without_airflow():
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) >= 10, "the modules were found and imported"


def test_the_check_sees_a_module_that_imports_airflow():
    blocked = CHECK.replace("import airflow_provider_eos.utils as utils", "import airflow.sdk")
    done = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ImportError: airflow imported" in done.stderr
