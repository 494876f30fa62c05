"""A ``BatchSink`` on the real database without Spark: what a driver hands it, made by hand.

Tests of the sink's own transitions (fallbacks, isolation, retries) use it, so
each needs PostgreSQL only and no JVM.
"""

from __future__ import annotations

import datetime
import random
from dataclasses import fields, replace
from typing import Any

from psycopg2 import sql

from spark_apps.eos_stream.records.parsing import staging_columns, staging_lines
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.sink.batch_sink import BatchSink
from spark_apps.eos_stream.sink.modes import MODES
from spark_apps.eos_stream.sink.settings import SinkSettings
from spark_apps.eos_stream.sink.staging import copy_from_chunks
from spark_apps.ledger.generator import _event
from spark_apps.ledger.spec import LEDGER
from tests.streaming import pg_connect

Record = tuple[str, int, int, bytes | None, bytes | None]


class LedgerSink:
    """A ``BatchSink`` (exactly_once, or ``delivery``) over new ledger targets, ten records of one
    partition, staged as the executors would stage them.

    :param names: (target schema, meta schema, pipeline), e.g. a test pipeline config's, so the
        audit can read what the sink wrote; default: names made from ``unique_name``.
    :param sink_options: ``SinkSettings`` fields over the defaults below, or ``BatchSink``'s
        callbacks (``reconnect``, ``reconnect_guard``, ``notify``).
    """

    def __init__(self, stack: dict, unique_name: str, delivery: str = "exactly_once",
                 names: tuple[str, str, str] | None = None, **sink_options: Any) -> None:
        self.stack = stack
        self.spec = LEDGER
        self.target, self.meta, self.pipeline = names or (f"t_fb{unique_name}", f"m_fb{unique_name}",
                                                          f"fallback{unique_name}")
        rng, start = random.Random(5), datetime.datetime(2026, 1, 1)
        self.records: list[Record] = [("t", 0, offset, None, _event(rng, offset, 3, start)[1])
                                      for offset in range(10)]
        self.conn, self.guard = pg_connect(stack), pg_connect(stack)
        self.conn.autocommit = False
        mode = MODES[delivery]
        preflight.ensure_meta_tables(self.conn, self.meta)
        preflight.create_targets(self.conn, LEDGER, self.target, mode)
        settings = SinkSettings(spec=LEDGER, mode=mode, pipeline=self.pipeline, target_schema=self.target,
                                meta_schema=self.meta, max_batch_attempts=3, transient_retry_seconds=30)
        named = {f.name for f in fields(SinkSettings)}
        settings = replace(settings, **{k: v for k, v in sink_options.items() if k in named})
        self.sink = BatchSink(settings, conn=self.conn, guard_conn=self.guard,
                              **{k: v for k, v in sink_options.items() if k not in named})

    def __enter__(self) -> LedgerSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fill_stage(self, stage_name: str, keep_raw: bool) -> int:
        return self._stage(stage_name, keep_raw, self.records)

    def _stage(self, stage_name: str, keep_raw: bool, records: list[Record]) -> int:
        with self.conn.cursor() as cur:
            copy_from_chunks(cur, sql.Identifier(self.meta, stage_name), staging_columns(self.spec),
                             iter(["".join(staging_lines(self.spec, records, keep_raw)).encode()]))
        self.conn.commit()
        return len(records)

    def process(self, batch_id: int = 0) -> Any:
        """The batch of all ten records, from offset 0 to 10."""
        return self.sink.process(batch_id, {("t", 0): 0}, {("t", 0): 10}, self.fill_stage)

    def process_records(self, batch_id: int, records: list[Record]) -> Any:
        """One batch of ``records``, of any topics and partitions: each partition's range from its
        first record's offset to past its last one."""
        starts: dict[tuple[str, int], int] = {}
        ends: dict[tuple[str, int], int] = {}
        for topic, partition, offset, _key, _value in records:
            starts[(topic, partition)] = min(starts.get((topic, partition), offset), offset)
            ends[(topic, partition)] = max(ends.get((topic, partition), 0), offset + 1)
        return self.sink.process(batch_id, starts, ends,
                                 lambda stage_name, keep_raw: self._stage(stage_name, keep_raw, records))

    def events_and_count(self) -> tuple[tuple[int, int], int | None]:
        """((rows, distinct offsets) of ledger_events, sum of the balances' event counts)."""
        with self.conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT count(*), count(DISTINCT kafka_offset) FROM {}").format(
                sql.Identifier(self.target, "ledger_events")))
            events = cur.fetchone()
            cur.execute(sql.SQL("SELECT sum(event_count) FROM {}").format(
                sql.Identifier(self.target, "account_balances")))
            counted = cur.fetchone()[0]
        self.conn.commit()
        return events, counted

    def close(self) -> None:
        conn = self.sink.conn  # the sink may have reconnected
        if conn.closed:
            conn = pg_connect(self.stack)
        conn.rollback()
        with conn.cursor() as cur:
            for schema in (self.meta, self.target):
                cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        conn.commit()
        conn.close()
        for other in (self.conn, self.guard, self.sink.guard.conn):
            if not other.closed:
                other.close()
