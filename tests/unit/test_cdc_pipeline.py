"""A mirror pipeline's spec (spark_apps/eos_stream/cdc/pipeline.py): built from a config's
``mirror`` section (the earlier ``spec: "mirror:<file or inline>"`` read into it), staged one
line per Kafka record, refused where it cannot be exact. The apply runs on the real stack in
tests/integration/test_cdc_mirror.py."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from spark_apps.eos_stream.cdc import pipeline
from spark_apps.eos_stream.cdc.mirror import STAGE_COLUMNS
from spark_apps.eos_stream.records.spec import SpecError, SpecSource, load_spec, spec_of
from spark_apps.eos_stream.run.config import ConfigError, from_dict
from spark_apps.eos_stream.run.preflight import delivery_mode
from spark_apps.eos_stream.sink.staging import copy_chunks, stage_column_types

SECTION = {"topic_prefix": "app", "tables": [
    {"source": "public.customers", "key": ["id"], "columns": {"id": "bigint", "name": "text", "notes": "text"}},
    {"source": "public.lines", "key": ["order_id", "line_no"],
     "columns": {"order_id": "bigint", "line_no": "integer", "sku": "text", "qty": "integer"}}],
    "aggregates": [{"source": "public.lines", "target": "sku_totals", "group_by": ["sku"], "sums": {"q": "qty"}}]}
YAML = """
mirror:
  topic_prefix: app
  tables:
    - source: public.customers
      key: [id]
      columns: {id: bigint, name: text, notes: text}
"""


def _envelope(op: str, table: str, key: dict, after: dict | None) -> tuple[bytes, bytes]:
    value = {"op": op, "before": None, "after": after, "source": {"schema": "public", "table": table}}
    return json.dumps(key).encode(), json.dumps(value).encode()


def test_a_mirror_section_builds_a_spec_with_its_targets_and_ddl() -> None:
    spec = pipeline.mirror_spec(SECTION)
    assert spec.mirror is not None and spec.fields == () and spec.targets == ()
    assert spec.mirror.target_tables() == ["customers", "lines", "sku_totals"]
    assert stage_column_types(spec) == spec.mirror.stage_column_types()
    assert [c for c, _ in stage_column_types(spec)] == list(STAGE_COLUMNS)
    assert spec.target_ddl is not None and len(spec.target_ddl("t", False)) == 4


def test_a_config_of_the_earlier_shape_is_read_into_its_mirror_section(tmp_path: Path) -> None:
    path = tmp_path / "mirror.yaml"
    path.write_text(YAML)
    config = from_dict({"pipeline": "p", "topics": ["t"], "spec": f"mirror:{path}"})
    assert config.spec is None and config.mirror == yaml.safe_load(YAML)["mirror"]
    spec = spec_of(config)
    assert spec.mirror is not None and spec.mirror.target_tables() == ["customers"]
    inline = from_dict({"pipeline": "p", "topics": ["t"], "spec": "mirror:" + json.dumps(SECTION)})
    assert inline.spec is None and inline.mirror == SECTION and json.loads(inline.to_json())["mirror"] == SECTION
    with pytest.raises(ConfigError, match="either a spec or a mirror section"):
        from_dict({"pipeline": "p", "topics": ["t"], "spec": f"mirror:{path}", "mirror": SECTION})
    with pytest.raises(SpecError, match="is no Python spec"):
        load_spec(f"mirror:{path}")


def test_a_definition_file_that_is_no_mapping_is_refused(tmp_path: Path) -> None:
    (tmp_path / "list.yaml").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a mapping"):
        from_dict({"pipeline": "p", "topics": ["t"], "spec": f"mirror:{tmp_path / 'list.yaml'}"})


@pytest.mark.parametrize(("config", "message"), [
    ({"spec": "mirror:/no/such/file.yaml"}, "cannot read the mirror definition"),
    ({"spec": 'mirror:{"topic_prefix": "app"}'}, "mirror definition: mirror.tables: must list"),
    ({"mirror": {"topic_prefix": "app"}}, "mirror definition: mirror.tables: must list"),
])
def test_a_bad_definition_is_refused_naming_what_is_wrong(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec_of(from_dict({"pipeline": "p", "topics": ["t"], **config}))


def test_a_spark_task_builds_the_mirror_spec_once_per_process_from_plain_values() -> None:
    config = from_dict({"pipeline": "p", "topics": ["t"], "mirror": SECTION})
    source = SpecSource.of(config)
    assert source.reference is None and json.loads(source.mirror_json or "") == SECTION
    # What a task's closure carries: the pickled source, which builds the process's one spec.
    assert pickle.loads(pickle.dumps(source)).load() is spec_of(config) is source.load()
    python = SpecSource.of(from_dict({"pipeline": "p", "topics": ["t"], "spec": "spark_apps.ledger.spec:LEDGER"}))
    assert python.mirror_json is None and python.load() is load_spec("spark_apps.ledger.spec:LEDGER")


def test_the_executors_stage_one_line_per_record_tombstones_and_refusals_included() -> None:
    spec = pipeline.mirror_spec(SECTION)
    records = [_envelope("c", "customers", {"id": 1}, {"id": 1, "name": "a", "notes": "n"}),
               (json.dumps({"id": 1}).encode(), None),  # a tombstone
               _envelope("u", "lines", {"order_id": 1, "line_no": 2},
                         {"order_id": 1, "line_no": 2, "sku": "x", "qty": 3}),
               (b"{}", b"not json")]
    batch = pa.record_batch([pa.array(["t"] * 4), pa.array([0] * 4, pa.int32()), pa.array(range(4), pa.int64()),
                             pa.array([k for k, _ in records], pa.binary()),
                             pa.array([v for _, v in records], pa.binary())],
                            names=["topic", "partition", "offset", "key", "value"])
    counts = {"staged": 0}
    text = b"".join(bytes(c) for c in copy_chunks([batch], spec, False, counts)).decode()
    lines = [line.split("\t") for line in text.splitlines()]
    assert counts["staged"] == 4 and len(lines) == 4 and all(len(line) == len(STAGE_COLUMNS) for line in lines)
    error = STAGE_COLUMNS.index("_error")
    target = STAGE_COLUMNS.index("_target")
    assert [line[target] for line in lines] == ["customers", "\\N", "lines", "\\N"]
    assert [line[error] == "\\N" for line in lines] == [True, True, True, False]
    assert "malformed value JSON" in lines[3][error]


@pytest.mark.parametrize("delivery", ["at_least_once", "idempotent"])
def test_a_mirror_is_refused_in_a_mode_without_stored_offsets(delivery: str) -> None:
    config = from_dict({"pipeline": "p", "topics": ["app.public.customers"], "mirror": SECTION,
                        "delivery": delivery})
    with pytest.raises(ConfigError, match="cannot keep a mirror equal to its source"):
        config.validate()
    with pytest.raises(ConfigError, match="cannot keep a mirror equal to its source"):
        delivery_mode(config, spec_of(config))


def test_exactly_once_and_two_phase_take_a_mirror() -> None:
    for delivery in ("exactly_once", "two_phase"):
        config = from_dict({"pipeline": "p", "topics": ["t"], "mirror": SECTION, "delivery": delivery})
        assert delivery_mode(config.validate(), spec_of(config)).stores_offsets


def test_a_pipeline_definition_with_a_mirror_section_yields_the_apps_mirror_spec() -> None:
    from airflow_provider_eos.utils.pipeline_definition import PipelineDefinitionError, parse_definition

    data = {"name": "shop", "topics": ["app.public.customers", "app.public.lines"], "mirror": SECTION,
            "target_schema": "shop", "meta_schema": "shop_eos", "checkpoint_dir": "/ck/shop"}
    definition = parse_definition(data, source="shop.yaml")
    config = definition.app_config(kafka_bootstrap="k:9092", postgres={"host": "h"})
    assert config["spec"] is None and config["mirror"] == SECTION  # its own field, as the file holds it
    spec = spec_of(from_dict(config))
    assert spec.mirror is not None and spec.mirror.target_tables() == ["customers", "lines", "sku_totals"]
    with pytest.raises(PipelineDefinitionError, match="cannot keep a mirror equal to its source"):
        parse_definition({**data, "delivery": "at_least_once"}, source="shop.yaml")
    with pytest.raises(PipelineDefinitionError, match="either a spec or a mirror section"):
        parse_definition({**data, "spec": "a.b:C"}, source="shop.yaml")
    # The earlier shape, read into the same field when the definition loads.
    earlier = {key: value for key, value in data.items() if key != "mirror"}
    assert parse_definition({**earlier, "spec": "mirror:" + json.dumps(SECTION)}, source="shop.yaml") == definition


def test_a_batch_of_one_megabyte_records_is_staged_in_chunks_of_about_the_bound() -> None:
    spec = pipeline.mirror_spec(SECTION)
    notes = "x" * (1 << 20)  # a record of about 1 MB: its line holds the value again as JSON
    records = [_envelope("c", "customers", {"id": i}, {"id": i, "name": "a", "notes": notes}) for i in range(20)]
    batch = pa.record_batch([pa.array(["t"] * 20), pa.array([0] * 20, pa.int32()), pa.array(range(20), pa.int64()),
                             pa.array([k for k, _ in records], pa.binary()),
                             pa.array([v for _, v in records], pa.binary())],
                            names=["topic", "partition", "offset", "key", "value"])
    chunks = [bytes(c) for c in copy_chunks([batch], spec, False, {"staged": 0})]
    line = len(chunks[-1].splitlines()[-1]) + 1
    assert line > 1 << 20 and len(chunks) == -(-20 * line // pipeline.STAGE_CHUNK_CHARS)
    assert all(len(c) < pipeline.STAGE_CHUNK_CHARS + line for c in chunks)
    assert sum(c.count(b"\n") for c in chunks) == 20


def test_bounded_chunks_keeps_whole_lines_and_an_empty_batch_its_one_empty_chunk() -> None:
    assert list(pipeline.bounded_chunks(iter([]), 10)) == [b""]
    assert list(pipeline.bounded_chunks(["abc\n", "defgh\n", "ij\n", "k\n"], 10)) == [b"abc\ndefgh\n", b"ij\nk\n"]


def test_a_mirror_tables_columns_keep_their_order_to_the_app_and_its_tasks() -> None:
    """The app creates a mirror table's columns in the order its definition gives them: the
    section keeps its key order through the config file and into the Spark tasks' spec."""
    from spark_apps.eos_stream.cdc.definition import parse_mirror
    from spark_apps.eos_stream.run.config import from_dict

    order = ["id", "zeta", "alpha", "mid"]
    section = {"topic_prefix": "app", "tables": [{"source": "public.t", "key": ["id"],
                                                  "columns": {name: "text" for name in order}}]}
    config = from_dict({"pipeline": "p", "topics": ["app.public.t"], "mirror": section, "checkpoint_dir": "/ck"})
    shipped = from_dict(json.loads(config.to_json()))
    assert list(shipped.mirror["tables"][0]["columns"]) == order
    in_tasks = parse_mirror(json.loads(SpecSource.of(shipped).mirror_json or "{}"))
    assert list(in_tasks.tables["public.t"].columns) == order
