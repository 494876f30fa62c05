"""``eos validate``: the definitions a platform team checks in its own CI (no network, no Airflow)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from airflow_provider_eos.cli import main, run_checks

ROOT = Path(__file__).resolve().parents[2]
# The command as the console script runs it, from this checkout's code.
EOS = [sys.executable, "-m", "airflow_provider_eos.cli"]


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


def test_version_names_the_provider_version() -> None:
    from airflow_provider_eos import __version__

    result = subprocess.run([*EOS, "--version"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert (result.returncode, result.stdout.strip()) == (0, f"eos (airflow-provider-eos) {__version__}")


def _config_command(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``eos config`` in a process of its own, with the deployment's two connections in its
    environment as Airflow reads them (``AIRFLOW_CONN_*``)."""
    import os

    env = {**os.environ,
           "AIRFLOW_CONN_KAFKA_DEFAULT": json.dumps({"conn_type": "kafka",
                                                     "extra": {"bootstrap.servers": "k1:9092,k2:9092"}}),
           "AIRFLOW_CONN_EOS_POSTGRES": "postgres://eos:s3cret@db.example:5433/warehouse?sslmode=require"}
    return subprocess.run([*EOS, "config", *args, "--dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


def test_config_prints_the_app_config_the_app_accepts(tmp_path: Path) -> None:
    from spark_apps.eos_stream.run.config import from_dict

    (tmp_path / "orders.yaml").write_text(_definition("orders", delivery="two_phase"))
    result = _config_command(tmp_path, "orders")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert config["pipeline"] == "orders" and config["delivery"] == "two_phase"
    assert config["kafka_bootstrap"] == "k1:9092,k2:9092"
    assert config["postgres"] == {"host": "db.example", "port": 5433, "dbname": "warehouse", "user": "eos",
                                  "options": {"sslmode": "require"}}
    assert "s3cret" not in result.stdout  # the password travels in EOS_PG_PASSWORD only
    app = from_dict(config).validate()  # what the app and the audit read with --config FILE
    assert (app.pipeline, app.target_schema, app.meta_schema) == ("orders", "t_orders", "m_orders")


def test_config_without_connections_and_for_an_unknown_pipeline(tmp_path: Path) -> None:
    (tmp_path / "orders.yaml").write_text(_definition("orders"))
    out = io.StringIO()
    assert main(["config", "orders", "--dir", str(tmp_path), "--no-connections"], out=out) == 0
    config = json.loads(out.getvalue())
    assert (config["kafka_bootstrap"], config["postgres"], config["topics"]) == ("", {}, ["orders.events"])
    out = io.StringIO()
    assert main(["config", "returns", "--dir", str(tmp_path), "--no-connections"], out=out) == 1
    assert out.getvalue().startswith("FAIL returns: ")
