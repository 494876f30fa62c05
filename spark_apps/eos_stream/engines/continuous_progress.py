"""The continuous engine's progress rows: one per ``stop_poll_seconds`` at most, summing the
cycles committed since the last (``shared.ProgressRows``, as the Spark engine writes one per batch)."""

from __future__ import annotations

import time
from typing import Any

from spark_apps.eos_stream.engines.shared import ProgressRows
from spark_apps.eos_stream.kafka.offsets import to_json as offsets_to_json
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.run.config import PipelineConfig


class Progress:
    """The progress table's rows (``shared.ProgressRows``, as the Spark engine writes one per
    batch): one per ``stop_poll_seconds`` at most, summing the cycles committed since the last, so
    sensors and health read a continuous pipeline as they read a Spark one without a row per cycle."""

    def __init__(self, config: PipelineConfig, run_id: str) -> None:
        self.rows_table = ProgressRows(config.meta_schema, config.pipeline, run_id)
        self._reset()

    def _reset(self) -> None:
        self.cycles, self.rows, self.last_batch = 0, 0, -1
        self.starts: dict[TopicPartition, int] = {}
        self.ends: dict[TopicPartition, int] = {}
        self.since = time.monotonic()

    def add(self, batch_id: int, starts: dict[TopicPartition, int], ends: dict[TopicPartition, int],
            rows: int) -> None:
        self.cycles, self.rows, self.last_batch = self.cycles + 1, self.rows + rows, batch_id
        self.starts = {**starts, **self.starts}  # each partition's first start
        self.ends.update(ends)

    def record(self, conn: Any) -> None:
        """Writes the row of the cycles since the last (none: nothing) and its EOS-PROGRESS line."""
        if not self.cycles:
            return
        millis = round((time.monotonic() - self.since) * 1000)
        table = self.rows_table
        ends = offsets_to_json(self.ends)
        table.write(conn, table.row(self.last_batch, self.rows, offsets_to_json(self.starts), ends,
                                    {"cycles": self.cycles, "triggerExecution": millis}, millis))
        table.announce(self.last_batch, self.rows, millis, ends, cycles=self.cycles)
        self._reset()
