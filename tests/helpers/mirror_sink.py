"""A mirror pipeline's sink on the real PostgreSQL, over fresh schemas, fed Arrow batches of
Kafka records as the executors stage them (tests/integration/test_cdc_*_sink.py)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from psycopg2 import sql

from spark_apps.eos_stream.cdc.pipeline import mirror_spec
from spark_apps.eos_stream.records.spec import StageCount
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.sink.batch_sink import BatchSink
from spark_apps.eos_stream.sink.modes import MODES
from spark_apps.eos_stream.sink.settings import SinkSettings
from spark_apps.eos_stream.sink.staging import copy_chunks, copy_from_chunks, stage_column_types, stage_table
from spark_apps.eos_stream.state.ddl import run_ddl
from tests.streaming import pg_connect


class MirrorSink:
    """The sink of the mirror ``section`` in exactly_once (or ``delivery``), its targets created in ``target``,
    its bookkeeping in ``meta``; ``stage`` COPYs an Arrow batch into a batch's stage."""

    def __init__(self, stack: dict[str, str], section: dict[str, Any], target: str, meta: str, name: str,
                 max_batch_attempts: int = 1, delivery: str = "exactly_once") -> None:
        self.spec = mirror_spec(section)
        assert self.spec.mirror is not None and self.spec.target_ddl is not None
        self.stack, self.target, self.meta, self.name = stack, target, meta, name
        self.conn, self.guard = pg_connect(stack), pg_connect(stack)
        self.conn.autocommit = False
        preflight.ensure_meta_tables(self.conn, self.meta)
        with self.conn.cursor() as cur:
            run_ddl(cur, self.spec.target_ddl(self.target, False))
        self.conn.commit()
        settings = SinkSettings(spec=self.spec, mode=MODES[delivery], pipeline=self.name,
                                target_schema=self.target, meta_schema=self.meta,
                                max_batch_attempts=max_batch_attempts, transient_retry_seconds=0)
        self.sink = BatchSink(settings, conn=self.conn, guard_conn=self.guard)

    def stage(self, stage_name: str, keep_raw: bool, batch: pa.RecordBatch) -> StageCount:
        """What a task does with its records: their stage lines COPYed on a session of its own;
        returns what it reports (its lines, and a whole mirror's transaction groups)."""
        stager = pg_connect(self.stack)
        counts: dict[str, Any] = {"staged": 0}
        try:
            with stager.cursor() as cur:
                copy_from_chunks(cur, stage_table(self.meta, stage_name), [c for c, _ in stage_column_types(self.spec)],
                                 copy_chunks([batch], self.spec, keep_raw, counts))
        finally:
            stager.close()
        return StageCount(counts["staged"], counts.get("groups"))

    def close(self) -> None:
        self.conn.rollback()
        with self.conn.cursor() as cur:
            for schema in (self.target, self.meta):
                cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        self.conn.commit()
        self.conn.close()
        self.guard.close()
