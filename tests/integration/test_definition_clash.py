"""The DAG processor's view (``airflow dags list --local``) of definition folders a team gets wrong:
a newcomer claiming a running pipeline's target tables is the only one refused, and a definition
folder that is empty or missing shows as one invalid DAG and an ERROR, never as silence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.test_dags import airflow_env  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _definition(name: str, target_schema: str) -> str:
    return json.dumps({"name": name, "topics": [f"{name}.events"], "spec": "spark_apps.ledger.spec:LEDGER",
                       "target_schema": target_schema, "meta_schema": f"m_{name}",
                       "checkpoint_dir": f"/ck/{name}"})


def _dags(env: dict[str, str], folder: Path) -> dict[str, str]:
    """The DAG ids the DAG processor parses from dags/ with ``folder`` as the definition folder, with
    each DAG's description."""
    result = subprocess.run(["airflow", "dags", "list", "--local", "-o", "json",
                             "--columns", "dag_id,description"],
                            env={**env, "AIRFLOW__EOS__PIPELINE_CONFIG_DIR": str(folder),
                                 "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags")},
                            cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    # The JSON is the last line; the parse's log lines may come before it or on stderr.
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    return {row["dag_id"]: row.get("description") or "" for row in rows}


def test_only_the_newcomer_is_refused_and_an_empty_or_missing_folder_says_so(
        airflow_env, tmp_path: Path) -> None:  # noqa: F811 - imported fixture
    env = {**airflow_env, "PATH": f"{Path(sys.executable).parent}:{airflow_env.get('PATH', os.environ['PATH'])}"}
    running = tmp_path / "running"
    running.mkdir()
    (running / "shipments.yaml").write_text(_definition("shipments", "shop"))
    before = _dags(env, running)
    shipments = {f"eos_{kind}__shipments" for kind in ("stream", "stop", "health", "snapshot", "recovery")}
    assert shipments <= set(before) and not [d for d in before if d.startswith("eos_invalid__")]

    # Another team adds returns.yaml, later, with the same target tables (shop.ledger_events...).
    old = time.time() - 3600
    os.utime(running / "shipments.yaml", (old, old))
    (running / "returns.yaml").write_text(_definition("returns", "shop"))
    after = _dags(env, running)
    assert shipments <= set(after), "the running pipeline lost DAGs to the newcomer"
    assert "eos_invalid__returns" in after and not [d for d in after if d.endswith("__returns")
                                                    and d != "eos_invalid__returns"]
    why = after["eos_invalid__returns"]
    assert "belong to pipeline 'shipments'" in why and "give this pipeline its own target_schema" in why, why

    for folder in (tmp_path / "empty", tmp_path / "missing"):
        if folder.name == "empty":
            folder.mkdir()
        found = _dags(env, folder)
        assert [d for d in found if d.startswith("eos_")] == ["eos_invalid__pipeline_config_dir"], found
        assert "no pipeline definition" in found["eos_invalid__pipeline_config_dir"], found
        # The DAG processor's log has it at ERROR (the factory's own logger; the unit test reads it).
