"""The writer: prepares a staged batch inside one transaction (apply, offsets, dead letters)
without committing it; the committer (``committer``) finishes it. The failure transitions
of a batch (1-10) are in ``batch_sink``'s docstring, which drives both."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg2
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream import errors
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.spec import BatchRun, PipelineSpec, StageCount
from spark_apps.eos_stream.sink import apply_sql
from spark_apps.eos_stream.sink.in_doubt import prepare_failure, transaction_id
from spark_apps.eos_stream.sink.modes import DeliveryMode
from spark_apps.eos_stream.sink.offsets_store import OffsetsStore
from spark_apps.eos_stream.state import fencing

_UNKNOWN = StageCount(None)  # no stager's report: the rows unknown, no groups


@dataclass(frozen=True)
class StagedBatch:
    """A batch already in its staging table (``apply_ahead``: staged while the
    previous batch applied): its table name, what its stagers reported (their
    rows, None: unknown, and a whole mirror's transaction groups) and how long
    staging took."""

    name: str
    count: StageCount
    stage_ms: int = 0


@dataclass
class BatchResult:
    batch_id: int
    applied: int
    dead_lettered: int
    record_by_record: bool
    timings_ms: dict[str, int]
    transient_retries: int = 0


@dataclass
class PreparedBatch:
    """A batch applied inside a still-open (or, in two_phase, PREPAREd) transaction on ``conn``."""

    conn: PgConnection
    batch_id: int
    applied: int
    dead_lettered: int
    transaction_id: str | None = None


class BatchWriter:
    """Prepares a staged batch: applies it and advances offsets, without committing."""

    def __init__(
        self,
        conn: PgConnection,
        spec: PipelineSpec,
        mode: DeliveryMode,
        offsets: OffsetsStore,
        target_schema: str,
        meta_schema: str,
        epoch: int | None = None,
    ) -> None:
        self.conn = conn
        self.spec = spec
        self.mode = mode
        self.offsets = offsets
        self.meta_schema = meta_schema
        self.target_schema = target_schema
        self.epoch = epoch
        self._statement = functools.partial(
            apply_sql.apply_batch_statement,
            spec,
            target_schema=target_schema,
            meta_schema=meta_schema,
            skip_applied=mode.stores_offsets,
            upsert_rows=mode.upsert_rows,
        )

    def prepare(
        self,
        stage: sql.Composed,
        batch_id: int,
        start_offsets: Mapping[TopicPartition, int],
        end_offsets: Mapping[TopicPartition, int],
        record_by_record: bool,
        staged: StageCount = _UNKNOWN,
    ) -> PreparedBatch:
        """:param staged: what the successful stagers reported: their rows (None: unknown, so a
        deduping mode dedupes), a whole mirror's transaction groups as they counted them, and
        whether they decided the transactions (``walked``: the stage is what applies now)."""
        params = {"pipeline": self.offsets.pipeline}

        def apply(cur) -> tuple[int, int]:
            # Counted only where copies matter (a deduping mode: every mirror's), and before a
            # mirror's batch_run, which may rewrite the stage (whole transactions). A walked stage
            # was made from one read of each record.
            once = not record_by_record and self.mode.dedupe and (
                staged.walked or self._staged_once(cur, stage, staged.rows))
            run = self._batch_run(cur, stage, once, staged, start_offsets)
            if record_by_record:
                return self._apply_each(cur, stage, params, run)
            return run(cur, self.mode.dedupe and not once, False, params)

        return self._in_batch_transaction(batch_id, start_offsets, end_offsets, apply)

    def _batch_run(self, cur, stage: sql.Composed, staged_once: bool, staged: StageCount,
                   starts: Mapping[TopicPartition, int]) -> BatchRun:
        """How this batch's transaction applies the stage: the spec's statement, or a mirror's
        (``PipelineSpec.mirror``, which first makes the batch's schema changes on ``cur``)."""
        if self.spec.mirror is not None:
            return self.spec.mirror.batch_run(cur, stage, target_schema=self.target_schema,
                                              meta_schema=self.meta_schema, skip_applied=self.mode.stores_offsets,
                                              pipeline=self.offsets.pipeline, staged_once=staged_once,
                                              groups=staged.groups, walked=staged.walked, starts=starts)

        def run(cur, dedupe: bool, only_range: bool, params: dict) -> tuple[int, int]:
            cur.execute(self._statement(stage=stage, dedupe=dedupe, only_range=only_range), params)
            row = cur.fetchone()
            assert row is not None
            return int(row[0]), int(row[1])

        return run

    def _in_batch_transaction(
        self,
        batch_id: int,
        start_offsets: Mapping[TopicPartition, int],
        end_offsets: Mapping[TopicPartition, int],
        apply: Callable[[Any], tuple[int, int]],
    ) -> PreparedBatch:
        """The batch transaction around ``apply`` (which returns (applied,
        dead-lettered)): the pipeline lock and the ownership check first, the
        offsets last, then PREPARE in two_phase. Leaves the transaction open
        for the committer, or for abort()."""
        gid = transaction_id(self.offsets.pipeline, start_offsets) if self.mode.two_phase else None
        if gid is not None:
            self.conn.tpc_begin(gid)
        with self.conn.cursor() as cur:
            self.offsets.lock(cur)
            self.check_ownership(cur, start_offsets)
            counts = apply(cur)
            if self.mode.stores_offsets:
                self.offsets.advance(cur, end_offsets, batch_id)
        if gid is not None:
            try:
                self.conn.tpc_prepare()  # durable from here on: a crash leaves it in doubt, not lost
            except psycopg2.Error as exc:
                # No free slot (53200) is no weather to wait out, nor any record's fault: say which setting.
                clear = prepare_failure(exc, gid)
                if clear is not None:
                    raise clear from exc
                raise
        return PreparedBatch(self.conn, batch_id, counts[0], counts[1], gid)

    @staticmethod
    def _staged_once(cur, stage: sql.Composed, staged_rows: int | None) -> bool:
        """Whether the stage holds each record once: exactly the rows the
        successful tasks reported (a count costs far less than the sort)."""
        if staged_rows is None:
            return False
        cur.execute(sql.SQL("SELECT count(*) FROM {}").format(stage))
        row = cur.fetchone()
        return row is not None and int(row[0]) == staged_rows

    def check_ownership(self, cur, start_offsets: Mapping[TopicPartition, int]) -> None:
        """Raises ``Fenced`` unless this driver still owns the target (under the
        pipeline lock, before the batch writes anything).

        Modes without stored offsets have no replay point in the database to
        compare with, so only their epoch is checked."""
        if self.epoch is None:
            return
        starts = start_offsets if self.mode.stores_offsets else {}
        problem = fencing.ownership_problem(cur, self.meta_schema, self.offsets.pipeline, self.epoch, starts)
        if problem:
            raise fencing.Fenced(problem)

    def abort(self) -> None:
        """Rolls back whatever this batch left open, a prepared transaction included."""
        if not self.mode.two_phase:
            try:
                self.conn.rollback()
            except psycopg2.Error:
                pass  # the connection is gone, and its transaction died with it
            return
        try:
            self.conn.tpc_rollback()  # ROLLBACK, or ROLLBACK PREPARED once prepared
        except psycopg2.ProgrammingError:
            self.conn.rollback()  # failed before tpc_begin (staging): a plain transaction
        except psycopg2.Error:
            # Connection gone: a prepared transaction stays in doubt and is
            # resolved at the next start; an unprepared one died with the session.
            pass

    def _apply_each(self, cur, stage: sql.Composed, params: dict, run: BatchRun) -> tuple[int, int]:
        """Applies the batch while isolating the records the database rejects
        (failure transition 6). Only coordinates come to the driver."""
        cur.execute(sql.SQL("CREATE INDEX ON {} (_topic, _partition, _offset)").format(stage))
        cur.execute(sql.SQL("SELECT DISTINCT _topic, _partition, _offset FROM {} ORDER BY 1, 2, 3").format(stage))
        coordinates = cur.fetchall()
        if not coordinates:
            return 0, 0
        quarantine = apply_sql.quarantine_record_statement(stage, self.meta_schema)
        return self._isolate(cur, functools.partial(run, cur, self.mode.dedupe, True), quarantine, params,
                             coordinates)

    def _isolate(self, cur, apply_range: Callable[[dict], tuple[int, int]], quarantine: sql.Composed, params: dict,
                 coordinates: list[tuple[str, int, int]]) -> tuple[int, int]:
        """Applies the records at ``coordinates`` (sorted) under a savepoint;
        a data error halves the range until the failing record stands alone,
        and that record alone is quarantined with the database's verdict.
        Ranges apply in coordinate order, as the whole batch would."""
        first, last = coordinates[0], coordinates[-1]
        bounds = {**params, "first_topic": first[0], "first_partition": first[1], "first_offset": first[2],
                  "last_topic": last[0], "last_partition": last[1], "last_offset": last[2]}
        cur.execute("SAVEPOINT eos_range")
        try:
            counts = apply_range(bounds)
            cur.execute("RELEASE SAVEPOINT eos_range")
            return counts
        except psycopg2.Error as exc:
            if errors.classify(exc) != "data":
                # Not a record's fault (a lock timeout, a lost connection, a
                # missing parent row): quarantining would lose a valid event.
                # The whole batch rolls back instead.
                raise
            cur.execute("ROLLBACK TO SAVEPOINT eos_range")
            cur.execute("RELEASE SAVEPOINT eos_range")
            if len(coordinates) == 1:
                topic, partition, offset = first
                error = f"rejected by the database: {(exc.pgerror or str(exc)).strip()}"
                cur.execute(quarantine, {**params, "topic": topic, "partition": partition, "offset": offset,
                                         "error": error, "sqlstate": errors.sqlstate_of(exc)})
                return 0, 1
        half = len(coordinates) // 2
        applied, dead = self._isolate(cur, apply_range, quarantine, params, coordinates[:half])
        more_applied, more_dead = self._isolate(cur, apply_range, quarantine, params, coordinates[half:])
        return applied + more_applied, dead + more_dead


