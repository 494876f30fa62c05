"""What every engine does around its batches, once claimed (``start``): the ``batch`` event, the
progress row with its ``progress`` event, the stop-and-fence poll, and a batch written as one
prepared part by an engine that reads in its own process (``write_one_part``).

An engine's batch is committed by the one sink (``BatchSink.process``), whose result every
engine reports the same way (``batch_event``). The progress table (``stream_progress``) holds
the rows sensors and health read, whichever engine wrote them (``ProgressRows``). The poll
(``poll_stop``) reads the stop request, ``run_seconds`` and the epoch on the driver's control
session (``Driver.stop_signal``: ``StopSignal``, which opens a lost session again).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from psycopg2 import sql

from spark_apps.eos_stream.events import emit
from spark_apps.eos_stream.kafka.offsets import to_json as offsets_to_json
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.spec import PipelineSpec
from spark_apps.eos_stream.sink import parts
from spark_apps.eos_stream.sink.batch_sink import BatchSink
from spark_apps.eos_stream.sink.parts import WrittenParts
from spark_apps.eos_stream.sink.writer import BatchResult
from spark_apps.eos_stream.state import fencing, meta_tables
from spark_apps.eos_stream.state.control import StopSignal


def batch_event(batch_id: int, result: BatchResult, end_offsets: Mapping[TopicPartition, int], **extra: Any) -> None:
    """The ``batch`` event of a committed batch: what the sink applied, dead-lettered and retried,
    its timings and end offsets, and the engine's own fields (``extra``)."""
    emit("batch", batch_id=batch_id, applied=result.applied, dead_lettered=result.dead_lettered,
         record_by_record=result.record_by_record, timings_ms=result.timings_ms,
         transient_retries=result.transient_retries, end_offsets=offsets_to_json(dict(end_offsets)), **extra)


class ProgressRows:
    """The progress table's rows of one run (``stream_progress``) and their ``progress`` event.

    :param offsets: a row's offsets as JSON text (None: unknown).
    """

    def __init__(self, meta_schema: str, pipeline: str, run_id: str) -> None:
        self.pipeline, self.run_id = pipeline, run_id
        self.insert = sql.SQL(
            "INSERT INTO {} (pipeline, run_id, batch_id, input_rows, start_offsets, end_offsets,"
            " durations_ms, batch_duration_ms) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT DO NOTHING").format(meta_tables.table(meta_schema, meta_tables.PROGRESS))

    def row(self, batch_id: int, rows: int, start_offsets: str | None, end_offsets: str | None,
            durations: dict[str, Any], millis: int | None) -> tuple[Any, ...]:
        return (self.pipeline, self.run_id, batch_id, rows, start_offsets, end_offsets, json.dumps(durations), millis)

    def write(self, conn: Any, row: tuple[Any, ...]) -> None:
        """Inserts ``row`` on ``conn`` (an autocommit session); a lost session raises, and the
        caller decides whether a new one writes it or the next row carries it."""
        with conn.cursor() as cur:
            cur.execute(self.insert, row)

    @staticmethod
    def announce(batch_id: int, rows: int, millis: int | None, end_offsets: Any, **extra: Any) -> None:
        """The ``progress`` event of a row: its rows, their rate and the end offsets."""
        emit("progress", batch_id=batch_id, input_rows=rows, **extra,
             rows_per_second=round(rows * 1000 / millis, 1) if millis else 0.0, end_offsets=end_offsets)


def poll_stop(stop: StopSignal, on_fenced: Callable[[], Any] | None = None) -> str | None:
    """One stop-and-fence poll: raises ``Fenced`` once the pipeline's epoch moved past this
    driver's (after ``on_fenced``: the Spark engine lets the batch in flight fail its own
    ownership check first); otherwise why the run must stop (a stop request, ``run_seconds``),
    or None."""
    fenced = stop.fenced()
    if fenced:
        if on_fenced is not None:
            on_fenced()
        raise fencing.Fenced(fenced)
    return stop.requested()


def write_one_part(sink: BatchSink, spec: PipelineSpec, batch_id: int, write: Callable[[str], dict[str, Any]],
                   on_failed: Callable[[], Any] | None = None) -> WrittenParts | None:
    """The batch written as one prepared part (a driver with one task: P1-P6), or None after
    rolling back whatever it left (P2: refused, or the write failed), when the sink stages it.

    :param write: writes the part named by its argument and returns its result (``part_writer``).
    :param on_failed: called first when it returns None (the continuous engine closes the part's
        session, which may have ended inside its transaction)."""
    prefix = sink.parts_prefix(batch_id)
    written = parts.write_batch(lambda prefix: [write(f"{prefix}0:0")], spec, prefix, batch_id,
                                time.perf_counter(), emit)
    if written is None:
        if on_failed is not None:
            on_failed()
        sink.drop_parts(prefix)
    return written
