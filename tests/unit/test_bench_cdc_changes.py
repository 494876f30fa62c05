"""bench/cdc_changes.py: the generated change records have the shape Debezium's connector writes
(compared with records the real connector wrote for the same table), the project's decoder reads
them, and the final rows it reports are what applying the records in order leaves."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench.cdc_changes import COLUMNS, ChangeStream, typed_row, value_schema, zoned_timestamp
from spark_apps.eos_stream.cdc.envelope import decoder

SAMPLE = json.loads((Path(__file__).with_name("debezium_bench_sample.json")).read_text())


def _same_shape(made: Any, real: Any) -> bool:
    """The same keys in the same order, and values of the same kinds (a null, of a nullable
    column or field, matches any kind)."""
    if isinstance(made, dict) and isinstance(real, dict):
        return list(made) == list(real) and all(_same_shape(made[k], real[k]) for k in made)
    return made is None or real is None or type(made) is type(real)


def _records(schemas: bool, prefix: str) -> list[tuple[str, bytes, bytes | None]]:
    return list(ChangeStream(1, 400, prefix=prefix, schema=SAMPLE["schema"], seed=3, schemas=schemas).records())


@pytest.mark.parametrize("schemas", [False, True])
def test_each_op_has_the_shape_the_real_connector_wrote(schemas: bool) -> None:
    mode = "schema" if schemas else "noschema"
    real = SAMPLE["records"][mode]
    made = _records(schemas, SAMPLE["topic_prefix"][mode])
    by_op: dict[str, Any] = {}
    for _, key, value in made:
        document = None if value is None else json.loads(value)
        payload = None if document is None else (document["payload"] if schemas else document)
        by_op.setdefault("tombstone" if payload is None else payload["op"], (key, document))
    for record in real:
        document = None if record["value"] is None else json.loads(record["value"])
        payload = None if document is None else (document["payload"] if schemas else document)
        key, generated = by_op["tombstone" if payload is None else payload["op"]]
        assert _same_shape(json.loads(key), json.loads(record["key"]))
        assert _same_shape(generated, document)
        if schemas and document is not None:  # the converter's schema itself, names included
            assert generated["schema"] == document["schema"]
            assert json.loads(key)["schema"] == json.loads(record["key"])["schema"]
    delete = next(json.loads(r["value"]) for r in real if r["value"] and '"op":"d"' in r["value"])
    generated_delete = next(json.loads(v) for _, _, v in made if v and b'"op":"d"' in v)
    if schemas:
        delete, generated_delete = delete["payload"], generated_delete["payload"]
    assert {k: v for k, v in generated_delete["before"].items() if k != "id"} == \
        {k: v for k, v in delete["before"].items() if k != "id"}  # the zero values of a delete's before


def test_the_value_schema_matches_the_connectors() -> None:
    real = json.loads(next(r["value"] for r in SAMPLE["records"]["schema"] if r["value"]))
    assert value_schema(SAMPLE["topic_prefix"]["schema"], SAMPLE["schema"], SAMPLE["table"]) == real["schema"]


def test_zoned_timestamps_drop_trailing_zeros_as_java_does() -> None:
    from datetime import datetime, timezone

    assert zoned_timestamp(datetime(1970, 1, 1, tzinfo=timezone.utc)) == "1970-01-01T00:00:00Z"
    assert zoned_timestamp(datetime(2026, 11, 27, 12, 0, 0, 120000, tzinfo=timezone.utc)) == "2026-11-27T12:00:00.12Z"
    assert zoned_timestamp(datetime(2026, 11, 27, 12, 0, 0, 123456, tzinfo=timezone.utc)) == \
        "2026-11-27T12:00:00.123456Z"


@pytest.mark.parametrize("schemas", [False, True])
def test_final_rows_are_the_records_applied_in_order(schemas: bool) -> None:
    """The reference the bench compares targets with: each key's last change, decoded by the
    project's own decoder (which must accept every record), applied in Kafka order."""
    stream = ChangeStream(3, 1500, prefix="app", seed=9, schemas=schemas)
    decode = decoder(lambda _table: COLUMNS)
    rows: dict[str, dict[int, tuple]] = {name: {} for name in ("t00", "t01", "t02")}
    ops: Counter = Counter()
    keys_changed: Counter = Counter()
    for topic, key, value in stream.records():
        change = decode(key, value)
        table = topic.rsplit(".", 1)[1]
        if change is None:
            ops["tombstone"] += 1
            continue
        ops[change.op] += 1
        keys_changed[(table, change.key["id"])] += 1
        assert change.table == f"public.{table}"
        if change.op == "d":
            del rows[table][change.key["id"]]
        else:
            assert value is not None and change.after is not None and not change.unchanged
            document = json.loads(value)
            rows[table][change.key["id"]] = typed_row((document["payload"] if schemas else document)["after"])
    assert rows == stream.final_rows()
    assert ops["c"] + ops["u"] + ops["d"] == 1500 and ops["tombstone"] == ops["d"]
    assert {op: ops[op] for op in ("c", "u", "d")} == {op: stream.counts[op] for op in ("c", "u", "d")}
    assert min(ops["u"], ops["d"]) > 150 and max(keys_changed.values()) > 3  # keys change more than once
    assert all(rows[t] for t in rows)


def test_the_stream_is_reproducible() -> None:
    first = list(ChangeStream(2, 500, prefix="p", seed=5).records())
    assert first == list(ChangeStream(2, 500, prefix="p", seed=5).records())
    assert first != list(ChangeStream(2, 500, prefix="p", seed=6).records())


def test_a_per_key_run_waits_for_the_change_topics_records_only() -> None:
    from bench.cdc_throughput import change_records

    for metadata, begins in ((True, True), (True, False), (False, True)):
        stream = ChangeStream(2, 300, prefix="t", seed=5, transaction_metadata=metadata, begins=begins)
        records = list(stream.records())
        changes = sum(1 for topic, _key, _value in records if topic != stream.transaction_topic())
        assert change_records(stream, {"records": len(records), **stream.counts}) == changes
        assert (changes < len(records)) is metadata


def test_a_whole_continuous_run_waits_for_the_transaction_topic_too() -> None:
    from bench.cdc_throughput import continuous_records

    stream = ChangeStream(2, 300, prefix="t", seed=5, transaction_metadata=True)
    records = list(stream.records())
    produced = {"records": len(records), **stream.counts}
    changes = sum(1 for topic, _key, _value in records if topic != stream.transaction_topic())
    assert continuous_records("mirror_continuous_whole", stream, produced) == len(records)
    assert continuous_records("mirror_continuous", stream, produced) == changes < len(records)
    assert continuous_records("mirror_whole", stream, produced) is None  # a Spark figure ends by itself


def test_without_begins_the_changes_are_the_same_and_the_transaction_topic_holds_the_ends_only() -> None:
    def stream(begins: bool) -> ChangeStream:
        return ChangeStream(2, 500, prefix="nb", schemas=True, transaction_metadata=True, begins=begins)

    ends_only = stream(False)
    with_begins, without = list(stream(True).records()), list(ends_only.records())
    topic = ends_only.transaction_topic()
    assert [r for r in with_begins if r[0] != topic] == [r for r in without if r[0] != topic]
    statuses = Counter(json.loads(value or b"{}")["payload"]["status"] for t, _, value in without if t == topic)
    assert statuses == Counter({"END": sum(1 for t, _, v in with_begins if t == topic and b'"BEGIN"' in (v or b""))})


def test_the_whole_cost_pairs_each_round_and_leaves_a_figure_without_its_per_key_one_out() -> None:
    from bench.cdc_throughput import whole_costs

    def run(batch: float, cpu: float) -> dict[str, float]:
        return {"batch_seconds": batch, "batch_busy_cpu_seconds": cpu}

    costs = whole_costs({"mirror": [run(10, 18), run(20, 20)], "mirror_whole": [run(11, 20), run(20, 25)],
                         "mirror_continuous_whole": [run(5, 9)]})
    assert costs == {"mirror_whole": {
        "batch": {"of_medians": round(1 - 15 / 15.5, 3), "median_of_rounds": round((1 - 10 / 11) / 2, 3), "rounds": 2},
        "batch_busy_cpu": {"of_medians": round(1 - 19 / 22.5, 3), "median_of_rounds": round((0.1 + 0.2) / 2, 3),
                           "rounds": 2}}}


def test_the_machines_busy_seconds_between_two_moments_are_read_between_its_samples() -> None:
    from bench.cpu_share import MachineBusy

    busy = MachineBusy(interval=60)
    busy.stop()
    busy.samples = [(100.0, 5.0), (102.0, 7.0), (104.0, 11.0)]
    assert busy.between(101.0, 103.0) == pytest.approx(9.0 - 6.0)
    assert busy.between(90.0, 110.0) == pytest.approx(11.0 - 5.0)  # outside the samples: their ends


def test_together_the_rates_are_taken_over_the_window_both_mirrors_run_warm() -> None:
    from bench.cdc_together import window_rates
    from bench.common import linear_at

    per_key = [(10.0, 100), (12.0, 300), (14.0, 500), (15.0, 600)]  # 100 a second
    whole = [(11.0, 90), (13.0, 270), (15.0, 450), (17.0, 600)]  # 90 a second
    assert linear_at(per_key, 11.0) == 200 and linear_at(per_key, 9.0) == 100 and linear_at(whole, 20.0) == 600
    measured = window_rates({"per_key": per_key, "whole": whole})
    assert measured == {"window_seconds": 4.0, "rates": {"per_key": 100, "whole": 90}, "cost": 0.1}


def test_a_batchs_end_offsets_sum_over_every_topic_or_the_ones_named() -> None:
    from bench.common import end_offsets_sum

    batch = {"end_offsets": json.dumps({"app.public.t00": {"0": 25, "1": 24}, "app.transaction": {"0": 9}})}
    assert end_offsets_sum(batch) == 58 and end_offsets_sum(batch, {"app.public.t00"}) == 49
