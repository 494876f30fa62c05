"""The mirror a Spark user would write without this project: Structured Streaming's Kafka source,
``foreachBatch``, Debezium's envelope decoded with ``from_json``, and per table an
``INSERT ... ON CONFLICT (id) DO UPDATE`` of the keys whose last change is a create or update
and a ``DELETE`` of the keys whose last change is a delete. At-least-once: the target commits
before Spark's checkpoint does, so a crash between them replays the batch.

Run by bench/cdc_throughput.py under spark-submit (the password arrives through the environment):

    spark-submit --py-files bench/cdc_peer.py bench/cdc_peer.py CONFIG_JSON

Its best settings, each chosen for speed without losing correctness:

* **Last change per key within the batch, without a shuffle.** Debezium keys each record by the
  row's primary key, so a key's changes share one Kafka partition, which the Kafka source reads
  as one Spark partition in offset order: a dict per partition keeps each key's last change. A
  ``Window`` over the key would order the same but shuffle every batch. Without it, ON CONFLICT
  would meet one row twice in one statement and fail ("cannot affect row a second time").
* **The decode in the JVM** (``from_json`` of only the fields it needs), so Python receives
  small rows, not the envelope's text.
* **One connection per Python worker**, kept across tasks and batches (Spark reuses its Python
  workers), not one per partition per batch.
* **``write``**: ``values`` sends the rows with psycopg2's ``execute_values`` (multi-row
  VALUES, pages of ``page_size``); ``copy`` COPYs them into a temporary table and merges it
  with one INSERT ... SELECT ... ON CONFLICT and one DELETE ... USING per table. Both are
  measured; the faster is the peer.
* ``maxOffsetsPerTrigger`` as the mirror's, ``availableNow``, ``local[2]``, the same
  ``spark.sql.shuffle.partitions``: the two read the same batches.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

COLUMNS = ("id", "name", "qty", "balance", "updated_at", "prefs")
CASTS = ("bigint", "text", "integer", "numeric(20,6)", "timestamptz", "jsonb")
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
_CONNECTION: list[Any] = []  # this Python worker's connection, kept across tasks


def _connection(config: dict[str, Any]) -> Any:
    import psycopg2

    if not _CONNECTION or _CONNECTION[0].closed:
        _CONNECTION[:] = [psycopg2.connect(password=os.environ["PGPASSWORD"], **config["postgres"])]
    return _CONNECTION[0]


def _last_changes(rows: Iterable[tuple]) -> dict[str, dict[int, tuple]]:
    """table -> id -> the key's last change of this partition (rows arrive in offset order):
    (tbl, id, op, *COLUMNS[1:]), read by position (a Row's fields by name cost a lookup each)."""
    last: dict[str, dict[int, tuple]] = {}
    for row in rows:
        if row[2] is not None:  # a tombstone carries nothing its delete did not
            last.setdefault(row[0], {})[row[1]] = row
    return last


def _table(schema: str, table: str) -> Any:
    from psycopg2 import sql

    return sql.Identifier(schema, table)


def _upsert_sql(schema: str, table: str, source: Any) -> Any:
    from psycopg2 import sql

    return sql.SQL("INSERT INTO {} ({}) {} ON CONFLICT (id) DO UPDATE SET {}").format(
        _table(schema, table), sql.SQL(", ").join(map(sql.Identifier, COLUMNS)), source,
        sql.SQL(", ").join(sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in COLUMNS[1:]))


def _write_values(cur: Any, schema: str, table: str, upserts: list[tuple], deletes: list[int],
                  page_size: int) -> None:
    from psycopg2 import sql
    from psycopg2.extras import execute_values

    if upserts:
        template = "(" + ", ".join(f"%s::{t}" for t in CASTS) + ")"
        statement = _upsert_sql(schema, table, sql.SQL("VALUES %s")).as_string(cur)
        execute_values(cur, statement, upserts, template=template, page_size=page_size)
    if deletes:
        cur.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(_table(schema, table)), (deletes,))


def _copy_cell(value: Any) -> str:
    return "\\N" if value is None else str(value).translate(_COPY_ESCAPES)


def _write_copy(cur: Any, schema: str, table: str, upserts: list[tuple], deletes: list[int]) -> None:
    from psycopg2 import sql

    cur.execute("CREATE TEMP TABLE IF NOT EXISTS peer_stage (id bigint, name text, qty integer, balance text,"
                " updated_at text, prefs text, deleted boolean) ON COMMIT DELETE ROWS")
    lines = ["\t".join(_copy_cell(v) for v in row) + "\tf\n" for row in upserts]
    lines += [f"{key}\t\\N\t\\N\t\\N\t\\N\t\\N\tt\n" for key in deletes]
    cur.copy_expert("COPY peer_stage FROM STDIN", io.StringIO("".join(lines)))
    if upserts:
        selected = sql.SQL(", ").join(sql.SQL("CAST({} AS {})").format(sql.Identifier(c), sql.SQL(t))
                                      for c, t in zip(COLUMNS, CASTS, strict=True))
        cur.execute(_upsert_sql(schema, table, sql.SQL("SELECT {} FROM peer_stage WHERE NOT deleted").format(selected)))
    if deletes:
        cur.execute(sql.SQL("DELETE FROM {} t USING peer_stage s WHERE s.deleted AND t.id = s.id").format(
            _table(schema, table)))
    cur.execute("TRUNCATE peer_stage")


def write_partition(config: dict[str, Any], rows: Iterable[Any]) -> None:
    """One Spark partition's last change per key, per table, in one transaction."""
    last = _last_changes(rows)
    if not last:
        return
    conn = _connection(config)
    with conn, conn.cursor() as cur:
        for table, changes in last.items():
            upserts = [(r[1], *r[3:]) for r in changes.values() if r[2] != "d"]
            deletes = [r[1] for r in changes.values() if r[2] == "d"]
            if config["write"] == "copy":
                _write_copy(cur, config["target_schema"], table, upserts, deletes)
            else:
                _write_values(cur, config["target_schema"], table, upserts, deletes, config["page_size"])


def _decoded(spark: Any, config: dict[str, Any]) -> Any:
    """The change topics as (tbl, id, op, the after image's columns): the envelope decoded in the JVM."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

    row = StructType([StructField("id", LongType()), StructField("name", StringType()),
                      StructField("qty", IntegerType()), StructField("balance", StringType()),
                      StructField("updated_at", StringType()), StructField("prefs", StringType())])
    envelope = StructType([StructField("op", StringType()), StructField("after", row),
                           StructField("source", StructType([StructField("table", StringType())]))])
    key = StructType([StructField("id", LongType())])
    if config["schemas"]:  # the converter's {"schema": ..., "payload": ...}
        envelope = StructType([StructField("payload", envelope)])
        key = StructType([StructField("payload", key)])
    raw = (spark.readStream.format("kafka")
           .option("kafka.bootstrap.servers", config["bootstrap"])
           .option("subscribe", ",".join(config["topics"]))
           .option("startingOffsets", "earliest")
           .option("kafka.isolation.level", "read_committed")
           .option("maxOffsetsPerTrigger", config["max_offsets_per_trigger"])
           .load())
    value = F.from_json(F.col("value").cast("string"), envelope)
    key_value = F.from_json(F.col("key").cast("string"), key)
    if config["schemas"]:
        value, key_value = value["payload"], key_value["payload"]
    decoded = raw.select(value.alias("e"), key_value["id"].alias("id"), F.col("topic"))
    # A tombstone (null value) has no source: its table is its topic's last name.
    return decoded.select(F.coalesce(F.col("e.source.table"), F.substring_index(F.col("topic"), ".", -1)).alias("tbl"),
                          "id", F.col("e.op").alias("op"), *[F.col(f"e.after.{c}").alias(c) for c in COLUMNS[1:]])


def main() -> None:
    # By reference (spark-submit --py-files ships this file): the workers import it once and keep
    # its connection; a function of __main__ would be pickled by value, its cache with it.
    from cdc_peer import write_partition as partition_writer
    from pyspark.sql import SparkSession

    config = json.loads(open(sys.argv[1]).read())
    spark = SparkSession.builder.appName(f"cdc-peer-{config['write']}").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")

    def apply(batch: Any, batch_id: int) -> None:
        started = time.time()
        batch.foreachPartition(lambda rows: partition_writer(config, rows))
        print("PEER-BATCH " + json.dumps({"batch_id": batch_id, "started_at": started, "committed_at": time.time()}),
              flush=True)

    query = (_decoded(spark, config).writeStream.foreachBatch(apply)
             .option("checkpointLocation", config["checkpoint_dir"]).trigger(availableNow=True).start())
    query.awaitTermination()
    print("PEER-DONE " + json.dumps({"finished_at": time.time()}), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
