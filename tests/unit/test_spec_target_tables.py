"""``PipelineSpec.target_tables``: every table a pipeline writes, which a snapshot takes and a
restore puts back; a mirror's tables and aggregates are not in ``targets`` (which it leaves
empty), so a snapshot that read ``targets`` took none of them."""

from __future__ import annotations

from spark_apps.eos_stream.cdc.pipeline import mirror_spec
from spark_apps.eos_stream.records.spec import load_spec
from tests.unit.test_cdc_pipeline import SECTION


def test_a_mirror_writes_its_tables_and_aggregates() -> None:
    spec = mirror_spec(SECTION)
    assert spec.targets == () and spec.target_tables() == ["customers", "lines", "sku_totals"]


def test_a_python_spec_writes_its_targets() -> None:
    spec = load_spec("spark_apps.ledger.spec:LEDGER")
    assert spec.target_tables() == [t.table for t in spec.targets] and spec.target_tables()
