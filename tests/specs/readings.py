"""A spec whose aggregates mean something only in SQL's terms: numeric sums (exact
decimals), an optional increment (NULL adds nothing), and timestamps as keys and
latest values (two spellings of one instant are one key, one value)."""

from __future__ import annotations

from psycopg2 import sql

from spark_apps.eos_stream.records.spec import AggregateTarget, Field, PipelineSpec, RowTarget


def readings_ddl(schema: str, unique_coordinates: bool = False) -> list[sql.Composable]:
    s = sql.Identifier(schema)
    return [
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(s),
        sql.SQL("CREATE TABLE IF NOT EXISTS {}.readings (kafka_topic text, kafka_partition int, kafka_offset bigint,"
                " sensor text, at timestamptz, value numeric, bonus bigint)").format(s),
        sql.SQL("CREATE TABLE IF NOT EXISTS {}.per_sensor (sensor text PRIMARY KEY, total numeric NOT NULL,"
                " bonus_total bigint, n bigint NOT NULL, last_at timestamptz)").format(s),
        sql.SQL("CREATE TABLE IF NOT EXISTS {}.per_instant (at timestamptz PRIMARY KEY, n bigint NOT NULL)").format(s),
    ]


READINGS = PipelineSpec(
    name="readings",
    fields=(Field("sensor", "text"), Field("at", "timestamptz"), Field("value", "numeric"),
            Field("bonus", "bigint", required=False)),
    targets=(
        RowTarget("readings", columns=("sensor", "at", "value", "bonus")),
        AggregateTarget("per_sensor", group_by=("sensor",),
                        increments={"total": "value", "bonus_total": "bonus", "n": None}, latest={"last_at": "at"}),
        AggregateTarget("per_instant", group_by=("at",), increments={"n": None}),
    ),
    target_ddl=readings_ddl,
)
