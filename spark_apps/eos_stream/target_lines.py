"""The direct write path's encoding: each record, once, in the shape of its targets.

The staged path COPYs every record into a staging table and then INSERTs it
into the targets: each row is written twice. The direct path (``sink/direct_rows``)
writes each row once, straight into its target, so a task encodes:

* for each row target, the COPY lines of its valid records (coordinates, then
  the target's columns);
* for each aggregate target, one *partial* per key: the task's sums and the
  key's last record. A batch's partials are merged in SQL with the same
  semantics as the staged path's aggregate over its records (``apply_sql``);
* its dead letters, in the staging table's layout, to be quarantined by the
  same SQL as the staged path's.

Pure Python: unit-tested without Spark or a database.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from spark_apps.eos_stream.records import NULL, RecordError, _encode, _encoder, parse_record
from spark_apps.eos_stream.spec import AggregateTarget, PipelineSpec, RowTarget

# (topic, partition, offset, key, value), as Kafka gives a record.
Record = tuple[str, int, int, bytes | None, bytes | None]

# Column names of a partials table besides the aggregate's keys, latest values and sums.
PARTIAL_PARTITION, PARTIAL_OFFSET = "_last_partition", "_last_offset"


def partial_columns(spec: PipelineSpec, target: AggregateTarget) -> list[tuple[str, str]]:
    """(name, PostgreSQL type) of a partials table, in the order of its COPY lines:
    the keys, a sum per increment, the last record's coordinates, its latest values."""
    types = {f.name: f.pg_type for f in spec.fields}

    return [
        *((key, types[key]) for key in target.group_by),
        # Python sums ints and Decimals exactly, as sum() over bigint and numeric does in numeric.
        *((f"_sum_{i}", "numeric") for i in range(len(target.increments))),
        (PARTIAL_PARTITION, "integer"),
        (PARTIAL_OFFSET, "bigint"),
        *((f"_latest_{i}", types[source]) for i, source in enumerate(target.latest.values())),
    ]


class _Partials:
    """One aggregate target's partials over one task's records."""

    def __init__(self, spec: PipelineSpec, target: AggregateTarget) -> None:
        self.keys = target.group_by
        self.increments = list(target.increments.values())
        self.latest = list(target.latest.values())
        checked = spec.transform is None
        types = {f.name: f.pg_type for f in spec.fields}
        self._key_encoders = [_encoder(types[k], checked) for k in self.keys]
        self._latest_encoders = [_encoder(types[s], checked) for s in self.latest]
        # key -> [sum per increment..., last partition, last offset, latest values...]
        self.by_key: dict[tuple, list[Any]] = {}

    def add(self, partition: int, offset: int, record: dict[str, Any]) -> None:
        key = tuple(record[k] for k in self.keys)
        partial = self.by_key.get(key)
        if partial is None:
            partial = self.by_key[key] = [None] * len(self.increments) + [partition, offset] + [None] * len(self.latest)
        for i, source in enumerate(self.increments):
            if source is None:  # count(*)
                partial[i] = (partial[i] or 0) + 1
                continue
            value = record[source]
            if value is not None:  # sum() skips NULLs, and is NULL when all are
                partial[i] = value if partial[i] is None else partial[i] + value
        at = len(self.increments)
        # The key's last record: the highest (partition, offset), as the staged
        # path's ORDER BY _partition DESC, _offset DESC picks it.
        if (partition, offset) >= (partial[at], partial[at + 1]):
            partial[at], partial[at + 1] = partition, offset
            for j, source in enumerate(self.latest):
                partial[at + 2 + j] = record[source]

    def lines(self) -> list[str]:
        at = len(self.increments)
        out = []
        for key, partial in self.by_key.items():
            cells = [encode(v) for encode, v in zip(self._key_encoders, key, strict=True)]
            cells += [NULL if v is None else repr(v) if isinstance(v, float) else str(v) for v in partial[:at]]
            cells += [str(partial[at]), str(partial[at + 1])]
            cells += [encode(v) for encode, v in zip(self._latest_encoders, partial[at + 2:], strict=True)]
            out.append("\t".join(cells) + "\n")
        return out


class TargetLines:
    """Encodes one task's records for the direct path.

    ``add`` returns each row target's COPY lines for the records given (so a
    task sends them on per Arrow batch); dead letters and partials build up
    until the task ends (``dead_letter_lines``, ``partial_lines``): they are
    bounded by the task's partition, as its staging was.
    """

    def __init__(self, spec: PipelineSpec) -> None:
        self.spec = spec
        checked = spec.transform is None
        types = {f.name: f.pg_type for f in spec.fields}
        self._rows = {i: [(c, _encoder(types[c], checked)) for c in t.columns]
                      for i, t in enumerate(spec.targets) if isinstance(t, RowTarget)}
        self._partials = {i: _Partials(spec, t) for i, t in enumerate(spec.targets) if isinstance(t, AggregateTarget)}
        self._dead_nulls = [NULL] * len(spec.fields)
        self.dead_letters: list[str] = []
        self.valid = 0
        self._topics: dict[str, str] = {}

    def add(self, records: Iterable[Record]) -> dict[int, list[str]]:
        """:param records: (topic, partition, offset, key, value) in Kafka order.
        :returns: row target index -> its COPY lines for these records."""
        lines: dict[int, list[str]] = {i: [] for i in self._rows}
        rows = [(lines[i], columns) for i, columns in self._rows.items()]
        partials = list(self._partials.values())
        topics = self._topics
        for topic, partition, offset, key, value in records:
            encoded_topic = topics.get(topic)
            if encoded_topic is None:
                encoded_topic = topics[topic] = _encode(topic)
            try:
                parsed = parse_record(self.spec, value)
            except RecordError as exc:
                # The staging table's layout, so the staged path's SQL quarantines it.
                self.dead_letters.append("\t".join([encoded_topic, str(partition), str(offset), _encode(key),
                                                    _encode(value), _encode(str(exc)), *self._dead_nulls]) + "\n")
                continue
            self.valid += 1
            coordinates = f"{encoded_topic}\t{partition}\t{offset}\t"
            for out, columns in rows:
                out.append(coordinates + "\t".join([encode(parsed[name]) for name, encode in columns]) + "\n")
            for partial in partials:
                partial.add(partition, offset, parsed)
        return lines

    def partial_lines(self) -> dict[int, list[str]]:
        """Aggregate target index -> the COPY lines of its partials table (``partial_columns``)."""
        return {i: partial.lines() for i, partial in self._partials.items()}
