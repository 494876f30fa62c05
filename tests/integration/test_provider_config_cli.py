"""`airflow config get-value eos <option>` shows every [eos] default the provider declares, and
an unset snapshot store stays unset (no default under /tmp), on a fresh AIRFLOW_HOME with this
checkout's provider. Needs Airflow, not the stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_provider_eos.utils import provider_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

# Every option through the CLI's own parser and `config get-value` command, in one interpreter
# (a fresh `airflow` process per option costs seconds each on 2 cores).
GET_VALUES = """
import contextlib, io, json, sys
from airflow.cli import cli_parser
parser = cli_parser.get_parser()
shown = {}
for option in sys.argv[1:]:
    args = parser.parse_args(["config", "get-value", "eos", option])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        args.func(args)
    shown[option] = out.getvalue().strip()
print("SHOWN " + json.dumps(shown))
"""


def _fresh_env(home: Path, **settings: str) -> dict[str, str]:
    # No AIRFLOW__EOS__* of the caller's: what shows is the provider's declaration.
    return {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(ROOT),
            "AIRFLOW_HOME": str(home), "HOME": str(home), **settings}


def test_airflow_config_get_value_shows_every_eos_default(tmp_path: Path) -> None:
    keys = [s.key for s in provider_config.SETTINGS]
    result = subprocess.run([sys.executable, "-c", GET_VALUES, *keys], env=_fresh_env(tmp_path), cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("SHOWN ")][-1]
    shown = json.loads(line[len("SHOWN "):])
    assert shown == {s.key: s.default or "" for s in provider_config.SETTINGS}
    assert shown["snapshot_store"] == ""  # required, no default


def test_the_airflow_command_shows_the_store_a_deployment_set(tmp_path: Path) -> None:
    """The real `airflow` executable (one process: seconds on 2 cores)."""
    result = subprocess.run([str(Path(sys.executable).with_name("airflow")), "config", "get-value", "eos",
                             "snapshot_store"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=_fresh_env(tmp_path, AIRFLOW__EOS__SNAPSHOT_STORE="s3://aws_default@bucket/eos"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["s3://aws_default@bucket/eos"]
