"""Schema-change rules of a mirror (spark_apps/eos_stream/cdc/schema_changes.py)."""

from __future__ import annotations

import pytest

from spark_apps.eos_stream.cdc.mirror import MirrorTarget
from spark_apps.eos_stream.cdc.pg_types import event_type, holds, normalize
from spark_apps.eos_stream.cdc.schema_changes import SchemaChangeRefused, plan_schema_changes
from spark_apps.eos_stream.cdc.values import FieldSchema

T = MirrorTarget("public.accounts", "accounts", ("id",),
                 {"id": "bigint", "owner": "text", "balance": "numeric(20,6)", "opened": "timestamptz"})


def propagated(source_type: str, length: str | None = None, scale: str | None = None,
               connect: str = "string") -> FieldSchema:
    params = {"__debezium.source.column.type": source_type}
    if length is not None:
        params["__debezium.source.column.length"] = length
    if scale is not None:
        params["__debezium.source.column.scale"] = scale
    return FieldSchema(connect, None, params)


def test_a_new_column_with_a_propagated_source_type_is_added_in_the_batch() -> None:
    plan = plan_schema_changes(T, "mirror", {"id": None, "fee": propagated("NUMERIC", "12", "2")})
    assert plan.new_columns == {"fee": "numeric(12,2)"}
    assert plan.add[0].type == "numeric(12,2)"
    assert (plan.add[0].schema, plan.add[0].table, plan.add[0].column) == ("mirror", "accounts", "fee")


@pytest.mark.parametrize(("schema", "pg_type"), [
    (FieldSchema("int32"), "integer"),
    (FieldSchema("string", "io.debezium.time.ZonedTimestamp"), "timestamptz"),
    (FieldSchema("string", "io.debezium.data.Json"), "jsonb"),
    (FieldSchema("int32", "io.debezium.time.Date"), "date"),
    (FieldSchema("array", None, {}, FieldSchema("int64")), "bigint[]"),
    (FieldSchema("bytes", "org.apache.kafka.connect.data.Decimal", {"scale": "6", "connect.decimal.precision": "20"}),
     "numeric(20,6)"),
    (propagated("_TEXT"), "text[]"),
    (propagated("VARCHAR", "40"), "character varying(40)"),
    (propagated("INT8", connect="int64"), "bigint"),
    (propagated("TIMESTAMPTZ"), "timestamptz"),
])
def test_event_types_that_name_one_postgresql_type(schema: FieldSchema, pg_type: str) -> None:
    assert event_type(schema) == pg_type


def test_a_new_plain_string_or_schemaless_column_is_refused_naming_it_and_the_fix() -> None:
    with pytest.raises(SchemaChangeRefused, match=r"column 'nickname' of public.accounts is new.*names no single type"
                                                   r".*mirror definition.*column.propagate.source.type"):
        plan_schema_changes(T, "mirror", {"nickname": FieldSchema("string")})
    with pytest.raises(SchemaChangeRefused, match=r"'nickname'.*carry no schema"):
        plan_schema_changes(T, "mirror", {"nickname": None})


def test_a_changed_type_is_refused() -> None:
    with pytest.raises(SchemaChangeRefused, match=r"'balance' of public.accounts changed type.*numeric\(20,6\).*"
                                                   r"numeric\(30,6\).*never converts"):
        plan_schema_changes(T, "mirror", {"balance": propagated("NUMERIC", "30", "6")})
    with pytest.raises(SchemaChangeRefused, match=r"'opened'.*bigint"):
        plan_schema_changes(T, "mirror", {"opened": FieldSchema("int64")})


def test_types_the_target_holds_without_loss_pass() -> None:
    plan = plan_schema_changes(T, "mirror", {"id": FieldSchema("int32"), "owner": propagated("VARCHAR", "20"),
                                             "balance": FieldSchema("string"),  # string mode: no type to compare
                                             "opened": FieldSchema("string", "io.debezium.time.ZonedTimestamp")})
    assert plan.add == [] and plan.dropped == []


def test_a_dropped_column_is_kept_and_named() -> None:
    plan = plan_schema_changes(T, "mirror", {"id": None, "owner": None}, rows_lacking=["opened", "balance"])
    assert plan.dropped == ["balance", "opened"] and plan.add == []


def test_normalize_and_holds() -> None:
    assert normalize("TIMESTAMP(3) WITH TIME ZONE") == "timestamp(3) with time zone"
    assert normalize("numeric( 20 , 6 )") == "numeric(20,6)" and normalize("int4[]") == "integer[]"
    assert holds("bigint", "integer") and holds("numeric", "numeric(20,6)") and holds("text", "character varying(5)")
    assert not holds("integer", "bigint") and not holds("numeric(20,6)", "numeric(30,6)")
    assert not holds("timestamptz", "bigint")


def test_every_refusal_of_a_batch_is_named_at_once() -> None:
    with pytest.raises(SchemaChangeRefused) as caught:
        plan_schema_changes(T, "mirror", {"a": None, "b": None})
    assert "'a'" in str(caught.value) and "'b'" in str(caught.value)


def test_shapes_staged_by_the_executors_plan_the_batch() -> None:
    from spark_apps.eos_stream.cdc.envelope import Change
    from spark_apps.eos_stream.cdc.mirror import shape_cell
    from spark_apps.eos_stream.cdc.schema_changes import plan_from_shapes

    same = Change("public.accounts", "u", {"id": 1}, None, {"id": 1, "owner": "a", "balance": 1}, frozenset({"opened"}))
    assert shape_cell(T, same) is None  # the common case stages nothing
    grown = Change("public.accounts", "c", {"id": 2}, None,
                   {"id": 2, "owner": "b", "balance": 1, "opened": None, "fee": 3},
                   row_schema={"fee": propagated("NUMERIC", "12", "2")})
    lacking = Change("public.accounts", "u", {"id": 3}, None, {"id": 3, "owner": "c", "opened": None})
    shapes = {shape_cell(T, grown), shape_cell(T, lacking)}
    plan = plan_from_shapes(T, "mirror", [s for s in shapes if s])
    assert plan.new_columns == {"fee": "numeric(12,2)"} and plan.dropped == ["balance"]
    untyped = Change("public.accounts", "c", {"id": 4}, None,
                     {"id": 4, "owner": "d", "balance": 1, "opened": None, "nick": "x"})
    with pytest.raises(SchemaChangeRefused, match="'nick'"):
        plan_from_shapes(T, "mirror", [shape_cell(T, untyped) or ""])
