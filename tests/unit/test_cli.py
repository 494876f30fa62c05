"""``eos validate``: the definitions a platform team checks in its own CI (no network, no Airflow)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from airflow_provider_eos.cli import main, run_checks


def _definition(name: str, **change: object) -> str:
    return json.dumps({"name": name, "topics": [f"{name}.events"], "spec": "spark_apps.ledger.spec:LEDGER",
                       "target_schema": f"t_{name}", "meta_schema": f"m_{name}",
                       "checkpoint_dir": f"/ck/{name}", **change})


def test_validate_says_ok_or_fail_per_file(tmp_path: Path) -> None:
    (tmp_path / "orders.yaml").write_text(_definition("orders"))
    (tmp_path / "late.yaml").write_text(_definition("late", snapshot={"schedule": "at noon"}))
    out = io.StringIO()
    assert main(["validate", str(tmp_path)], out=out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0] == "ok   orders"
    assert lines[1].startswith("FAIL late.yaml: ") and "snapshot.schedule" in lines[1]
    (tmp_path / "late.yaml").unlink()
    assert main(["validate", str(tmp_path)], out=io.StringIO()) == 0


def test_validate_refuses_an_empty_or_missing_directory(tmp_path: Path) -> None:
    out = io.StringIO()
    assert main(["validate", str(tmp_path)], out=out) == 1 and "no pipeline definitions" in out.getvalue()
    assert main(["validate", str(tmp_path / "nope")], out=io.StringIO()) == 1


def test_one_failing_check_hides_no_other() -> None:
    out = io.StringIO()

    def broken() -> str:
        raise ValueError("refused")

    assert run_checks([("a", broken), ("b", lambda: "fine")], out) == 1
    assert out.getvalue().splitlines() == ["FAIL a: refused", "ok   b: fine"]


def test_the_installed_command(tmp_path: Path) -> None:
    (tmp_path / "orders.yaml").write_text(_definition("orders"))
    eos = Path(sys.executable).parent / "eos"
    result = subprocess.run([str(eos), "validate", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (0, "ok   orders\n"), result.stderr
