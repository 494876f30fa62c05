"""Every example in docs/reference.md constructs: the reference cannot drift from the code."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from airflow.sdk import DAG

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def test_reference_examples_construct() -> None:
    blocks = re.findall(r"```python\n(.*?)```", REFERENCE.read_text(), flags=re.S)
    assert len(blocks) == 2
    with DAG("reference_examples", start_date=datetime(2026, 1, 1), schedule=None) as dag:
        for block in blocks:
            exec(compile(block, str(REFERENCE), "exec"), {})  # our own documentation, nothing external
    assert len(dag.task_ids) == 22
