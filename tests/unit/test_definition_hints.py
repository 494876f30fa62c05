"""What a new user's mistakes get: a typo anywhere in a definition, the mirror section too, is
refused with the nearest key and the keys allowed there; a missing folder, a missing connection
each get a message that says what to do."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_eos.cli import main

ROOT = Path(__file__).resolve().parents[2]
MIRROR = {"topic_prefix": "shop",
          "tables": [{"source": "public.customers", "key": ["id"], "columns": {"id": "bigint", "name": "text"}},
                     {"source": "public.order_lines", "key": ["order_id", "line_no"],
                      "columns": {"order_id": "bigint", "line_no": "integer", "sku": "text", "qty": "integer"}},
                     {"source_pattern": "inventory.*", "target": "inv_{table}"}],
          "aggregates": [{"source": "public.order_lines", "target": "sku_totals", "group_by": ["sku"],
                          "sums": {"qty_total": "qty"}}]}


def _mirror_pipeline(mirror: Any = MIRROR, key: str = "mirror") -> dict[str, Any]:
    return {"name": "shop_mirror", "topics": ["shop.public.customers"], "delivery": "exactly_once",
            "target_schema": "shop", "meta_schema": "shop_eos", "checkpoint_dir": "/ck/shop", key: mirror}


def _validate(tmp_path: Path, definition: dict[str, Any]) -> tuple[int, str]:
    (tmp_path / "shop_mirror.yaml").write_text(json.dumps(definition))
    out = io.StringIO()
    return main(["validate", str(tmp_path)], out=out), out.getvalue().strip()


def _typo(path: tuple[Any, ...], wrong: str) -> dict[str, Any]:
    """MIRROR with the key ``path[-1]`` of the mapping at ``path[:-1]`` spelled ``wrong``."""
    mirror = json.loads(json.dumps(MIRROR))
    holder = mirror
    for part in path[:-1]:
        holder = holder[part]
    holder[wrong] = holder.pop(path[-1]) if path[-1] in holder else "x"
    return mirror


def test_the_mirror_as_written_validates(tmp_path: Path) -> None:
    assert _validate(tmp_path, _mirror_pipeline()) == (0, "ok   shop_mirror")


TOP = "aggregates, placeholder, tables, topic_prefix, transactions"


@pytest.mark.parametrize(("path", "wrong", "where", "nearest", "allowed"), [
    (("aggregates",), "aggregats", "mirror.aggregats", "aggregates", TOP),
    (("placeholder",), "placeholdr", "mirror.placeholdr", "placeholder", TOP),
    (("aggregates", 0, "count_column"), "count_colum", "mirror.aggregates[0].count_colum", "count_column",
     "count_column, group_by, source, sums, target"),
    (("tables", 0, "key"), "keys", "mirror.tables[0].keys", "key", "columns, key, source, target"),
    (("tables", 2, "columns"), "colums", "mirror.tables[2].colums", "columns", "columns, source_pattern, target"),
])
def test_a_typo_at_any_level_of_the_mirror_is_refused(tmp_path: Path, path: tuple[Any, ...], wrong: str, where: str,
                                                      nearest: str, allowed: str) -> None:
    code, said = _validate(tmp_path, _mirror_pipeline(_typo(path, wrong)))
    assert code == 1
    assert said.endswith(f"invalid pipeline definition: {where}: unknown key; did you mean {nearest!r}? "
                         f"allowed here: {allowed}"), said


def test_a_misspelt_mirror_section_is_named(tmp_path: Path) -> None:
    code, said = _validate(tmp_path, _mirror_pipeline(key="mirrror"))
    assert code == 1
    assert "spec: required: name the spec (package.module:ATTRIBUTE), or give a mirror section" in said
    assert "mirrror: unknown key; did you mean 'mirror'? allowed here: airflow, cdc, " in said
    assert ", mirror, " in said


def test_a_mirror_file_with_a_typo_is_refused_as_the_inline_one(tmp_path: Path) -> None:
    mirror_file = tmp_path / "mirrors" / "shop.yaml"
    mirror_file.parent.mkdir()
    mirror_file.write_text(json.dumps({"mirror": _typo(("aggregates",), "aggregats")}))
    definition = _mirror_pipeline()
    del definition["mirror"]
    code, said = _validate(tmp_path, {**definition, "spec": f"mirror:{mirror_file}"})
    assert code == 1 and "mirror.aggregats: unknown key; did you mean 'aggregates'?" in said


def test_a_mirror_that_is_no_mapping(tmp_path: Path) -> None:
    code, said = _validate(tmp_path, _mirror_pipeline(["public.customers"]))
    assert code == 1 and said.endswith("mirror: must be a mapping (topic_prefix, tables...), not list")


def test_validate_of_a_missing_folder_names_the_argument_not_the_config(tmp_path: Path) -> None:
    out = io.StringIO()
    assert main(["validate", str(tmp_path / "nope")], out=out) == 1
    assert out.getvalue().strip() == (f"FAIL the pipeline definition directory {tmp_path / 'nope'} does not exist: "
                                      "name the directory that holds your <pipeline>.yaml files")
    assert "pipeline_config_dir" not in out.getvalue()


def _eos(tmp_path: Path, *args: str, **env: str) -> str:
    """The command in a process of its own, in a fresh Airflow home without connections."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW_CONN_", "AIRFLOW__"))}
    result = subprocess.run([sys.executable, "-m", "airflow_provider_eos.cli", *args], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env={**clean, "AIRFLOW_HOME": str(tmp_path / "airflow"), **env})
    assert result.returncode == 1, result.stdout + result.stderr
    return result.stdout.strip()


def test_config_without_connections_says_how_to_do_without(tmp_path: Path) -> None:
    (tmp_path / "shop_mirror.yaml").write_text(json.dumps(_mirror_pipeline()))
    said = _eos(tmp_path, "config", "shop_mirror", "--dir", str(tmp_path))
    assert said.startswith("FAIL shop_mirror: ") and "kafka_default" in said
    assert "run `eos config shop_mirror --no-connections`" in said


def test_a_missing_configured_folder_names_the_setting_and_dir(tmp_path: Path) -> None:
    said = _eos(tmp_path, "config", "shop_mirror", AIRFLOW__EOS__PIPELINE_CONFIG_DIR=str(tmp_path / "gone"))
    assert said == (f"FAIL shop_mirror: the pipeline definition directory {tmp_path / 'gone'} does not exist: set "
                    "[eos] pipeline_config_dir to the directory of your <pipeline>.yaml files, or give --dir")
