"""Snapshots of a pipeline's database state: the manifest model and the store.

A snapshot is two files in ``<store>/<pipeline>/<snapshot_id>/``:

``dump.pgc``
    one ``pg_dump -Fc`` of the pipeline's target tables and its bookkeeping
    tables, taken from one exported snapshot (so the data and the Kafka
    offsets stored beside it are from the same instant);
``manifest.json``
    what is in the dump: row count and checksum per table, the stored Kafka
    offsets (the replay point), the dump's size and SHA-256, the app version.

The manifest is written last: a directory without one is an unfinished
snapshot and is ignored (and removed by retention). The store is a local
directory or any :class:`airflow.sdk.ObjectStoragePath` (``s3://``,
``gs://``, ``file://`` ...); nothing here talks to PostgreSQL or Kafka.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

MANIFEST = "manifest.json"
DUMP = "dump.pgc"
FORMAT_VERSION = 1
LATEST = "latest"
_ID_RE = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{6}$")


class SnapshotError(ValueError):
    """A snapshot cannot be found, read or trusted; the message says which and why."""


@dataclass
class TableState:
    """One table as it was in the snapshot.

    :param schema: schema name.
    :param table: table name.
    :param rows: row count.
    :param checksum: order-independent checksum of the rows' text (see hooks.snapshot).
    :param role: ``target`` (pipeline data) or ``meta`` (bookkeeping).
    """

    schema: str
    table: str
    rows: int
    checksum: str
    role: str = "target"

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.table}"


@dataclass
class SnapshotManifest:
    """Everything known about one snapshot.

    :param snapshot_id: ``YYYYMMDDTHHMMSSZ-xxxxxx``, sorts by time.
    :param created_at: ISO-8601 UTC time of the exported snapshot.
    :param pipeline: pipeline name (keys the offsets).
    :param database: database name the dump came from.
    :param target_schema: schema of the target tables.
    :param meta_schema: schema of the bookkeeping tables.
    :param tables: per table row counts and checksums.
    :param kafka_offsets: ``{topic: {partition: next_offset}}`` the pipeline had
        stored at that instant: where a replay starts.
    :param dump_bytes: size of the dump file.
    :param dump_sha256: SHA-256 of the dump file.
    :param app_version: provider version that wrote it.
    :param server_version: PostgreSQL server version.
    :param other_pipelines: other pipelines with rows in the meta tables (a
        restore would roll them back too, so it refuses unless allowed).
    :param timings: seconds per phase of taking the snapshot.
    """

    snapshot_id: str
    created_at: str
    pipeline: str
    database: str
    target_schema: str
    meta_schema: str
    tables: list[TableState] = field(default_factory=list)
    kafka_offsets: dict[str, dict[str, int]] = field(default_factory=dict)
    dump_bytes: int = 0
    dump_sha256: str = ""
    app_version: str = ""
    server_version: str = ""
    other_pipelines: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def created(self) -> datetime:
        return parse_time(self.created_at)

    @property
    def total_rows(self) -> int:
        return sum(t.rows for t in self.tables)

    def offsets(self) -> dict[tuple[str, int], int]:
        """The replay point as ``{(topic, partition): next_offset}``."""
        return {(t, int(p)): int(o) for t, parts in self.kafka_offsets.items() for p, o in parts.items()}

    def table(self, schema: str, name: str) -> TableState:
        for state in self.tables:
            if (state.schema, state.table) == (schema, name):
                return state
        raise SnapshotError(f"snapshot {self.snapshot_id} has no table {schema}.{name}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def summary(self) -> dict[str, Any]:
        """A short form for logs and XCom."""
        return {
            "snapshot_id": self.snapshot_id,
            "created_at": self.created_at,
            "pipeline": self.pipeline,
            "database": self.database,
            "tables": {t.qualified: t.rows for t in self.tables},
            "total_rows": self.total_rows,
            "kafka_offsets": self.kafka_offsets,
            "dump_bytes": self.dump_bytes,
        }

    @classmethod
    def from_json(cls, text: str) -> SnapshotManifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SnapshotError(f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise SnapshotError("manifest is not a JSON object")
        if data.get("format_version") != FORMAT_VERSION:
            raise SnapshotError(
                f"manifest format {data.get('format_version')!r} is not supported (expected {FORMAT_VERSION})"
            )
        try:
            data["tables"] = [TableState(**t) for t in data.get("tables", [])]
            manifest = cls(**data)
        except TypeError as exc:
            raise SnapshotError(f"manifest has unexpected fields: {exc}") from exc
        manifest.created  # noqa: B018 -- validates the timestamp
        return manifest


def new_snapshot_id(now: datetime | None = None) -> str:
    now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return now.strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def parse_time(value: str | datetime) -> datetime:
    """An aware UTC datetime from ISO-8601 text (naive means UTC)."""
    if isinstance(value, datetime):
        parsed = value
    else:
        text = value.strip()
        if text.endswith("Z"):
            text = text[:-1] + "+00:00"
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError as exc:
            raise SnapshotError(
                f"{value!r} is neither 'latest', a snapshot id (YYYYMMDDTHHMMSSZ-xxxxxx) nor an ISO-8601 timestamp"
            ) from exc
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.astimezone(timezone.utc)


def select(manifests: Iterable[SnapshotManifest], selector: str) -> SnapshotManifest:
    """Chooses a snapshot: ``latest``, an exact id, or the newest taken at or
    before an ISO-8601 timestamp.

    :raises SnapshotError: nothing matches; the message lists what exists.
    """
    ordered = sorted(manifests, key=lambda m: (m.created, m.snapshot_id))
    selector = (selector or LATEST).strip()
    known = ", ".join(m.snapshot_id for m in ordered[-5:]) or "none"
    if not ordered:
        raise SnapshotError("the store holds no complete snapshot for this pipeline")
    if selector == LATEST:
        return ordered[-1]
    if _ID_RE.match(selector):
        for manifest in ordered:
            if manifest.snapshot_id == selector:
                return manifest
        raise SnapshotError(f"no snapshot with id {selector!r}; newest ones: {known}")
    limit = parse_time(selector)
    before = [m for m in ordered if m.created <= limit]
    if not before:
        raise SnapshotError(
            f"no snapshot taken at or before {limit.isoformat()}; the oldest is "
            f"{ordered[0].snapshot_id} ({ordered[0].created_at})"
        )
    return before[-1]


def retention_plan(manifests: Iterable[SnapshotManifest], keep_last: int) -> list[SnapshotManifest]:
    """The snapshots to delete so that only the newest ``keep_last`` remain."""
    if keep_last < 1:
        raise SnapshotError("keep_last must be at least 1: retention never deletes every snapshot")
    ordered = sorted(manifests, key=lambda m: (m.created, m.snapshot_id))
    return ordered[:-keep_last]


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _as_path(base: Any) -> Any:
    if isinstance(base, str):
        if "://" in base:
            from airflow.sdk import ObjectStoragePath

            return ObjectStoragePath(base)
        return Path(base)
    return base


class SnapshotStore:
    """Snapshots on a local directory or an ObjectStoragePath.

    :param base: root of the store: a local path, a URL (``s3://bucket/eos``,
        with ``conn_id`` in the URL's user part as Airflow allows) or an
        ObjectStoragePath.
    """

    def __init__(self, base: Any) -> None:
        self.base = _as_path(base)

    def __repr__(self) -> str:
        return f"SnapshotStore({str(self.base)!r})"

    def _dir(self, pipeline: str, snapshot_id: str | None = None) -> Any:
        if not pipeline or "/" in pipeline or pipeline.startswith("."):
            raise SnapshotError(f"invalid pipeline name {pipeline!r}")
        path = self.base / pipeline
        return path / snapshot_id if snapshot_id else path

    def dump_path(self, manifest: SnapshotManifest) -> Any:
        return self._dir(manifest.pipeline, manifest.snapshot_id) / DUMP

    def manifests(self, pipeline: str) -> list[SnapshotManifest]:
        """Complete snapshots of ``pipeline``, oldest first. Unreadable manifests
        are skipped (select() then cannot pick them)."""
        root = self._dir(pipeline)
        if not root.exists():
            return []
        out = []
        for child in root.iterdir():
            manifest_path = child / MANIFEST
            if not manifest_path.exists():
                continue
            try:
                out.append(SnapshotManifest.from_json(manifest_path.read_text()))
            except SnapshotError:
                continue
        return sorted(out, key=lambda m: (m.created, m.snapshot_id))

    def incomplete(self, pipeline: str) -> list[str]:
        """Directories without a manifest (an interrupted snapshot)."""
        root = self._dir(pipeline)
        if not root.exists():
            return []
        return sorted(c.name for c in root.iterdir() if not (c / MANIFEST).exists())

    def select(self, pipeline: str, selector: str) -> SnapshotManifest:
        return select(self.manifests(pipeline), selector)

    def save(self, manifest: SnapshotManifest, dump_file: str | Path) -> Any:
        """Copies the dump in, then writes the manifest (the commit point)."""
        target = self._dir(manifest.pipeline, manifest.snapshot_id)
        target.mkdir(parents=True, exist_ok=True)
        with open(dump_file, "rb") as src, (target / DUMP).open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        (target / MANIFEST).write_text(manifest.to_json())
        return target

    def fetch_dump(self, manifest: SnapshotManifest, local_file: str | Path) -> Path:
        """Copies the dump to a local file and checks its SHA-256 against the manifest."""
        source = self.dump_path(manifest)
        if not source.exists():
            raise SnapshotError(f"snapshot {manifest.snapshot_id}: dump file {source} is missing")
        local = Path(local_file)
        with source.open("rb") as src, open(local, "wb") as dst:
            _copy(src, dst)
        digest = sha256_file(local)
        if manifest.dump_sha256 and digest != manifest.dump_sha256:
            raise SnapshotError(
                f"snapshot {manifest.snapshot_id}: dump file is corrupted (sha256 {digest[:12]}... "
                f"!= manifest {manifest.dump_sha256[:12]}...)"
            )
        return local

    def delete(self, pipeline: str, snapshot_id: str) -> None:
        """Removes one snapshot: the manifest first, so a half-deleted one is never selected."""
        target = self._dir(pipeline, snapshot_id)
        for name in (MANIFEST, DUMP):
            path = target / name
            if path.exists():
                path.unlink()
        for leftover in list(target.iterdir()) if target.exists() else []:
            leftover.unlink()
        if target.exists():
            target.rmdir()

    def apply_retention(self, pipeline: str, keep_last: int) -> list[str]:
        """Keeps the newest ``keep_last`` complete snapshots; returns deleted ids.

        Incomplete directories older than the oldest kept snapshot go too."""
        manifests = self.manifests(pipeline)
        doomed = retention_plan(manifests, keep_last)
        for manifest in doomed:
            self.delete(pipeline, manifest.snapshot_id)
        kept = [m.snapshot_id for m in manifests if m not in doomed]
        deleted = [m.snapshot_id for m in doomed]
        if kept:
            for name in self.incomplete(pipeline):
                if name < kept[0]:
                    self.delete(pipeline, name)
                    deleted.append(name)
        return deleted


def _copy(src: BinaryIO, dst: BinaryIO) -> None:
    shutil.copyfileobj(src, dst, 1 << 20)


# ---------------------------------------------------------------------- pipelines and replay checks
def load_pipeline_config(source: Any, pipeline: str | None = None) -> Any:
    """The pipeline's :class:`spark_apps.eos_stream.config.PipelineConfig` from a
    dict or a JSON file path (no password: that comes from the Airflow connection).

    :param pipeline: when given, the config must name this pipeline.
    :raises SnapshotError: the file is missing (the message lists the configs
        beside it), unreadable, invalid, or for another pipeline.
    """
    from spark_apps.eos_stream.config import ConfigError, from_dict

    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            known = sorted(p.stem for p in path.parent.glob("*.json")) if path.parent.is_dir() else []
            raise SnapshotError(
                f"no pipeline config at {path}" + (f"; known pipelines there: {', '.join(known)}" if known else "")
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SnapshotError(f"cannot read pipeline config {path}: {exc}") from exc
    elif isinstance(source, dict):
        data = dict(source)
    else:
        raise SnapshotError(f"pipeline config must be a dict or a JSON file path, not {type(source).__name__}")
    try:
        config = from_dict(data).validate()
    except (ConfigError, TypeError) as exc:
        raise SnapshotError(f"invalid pipeline config: {exc}") from exc
    if pipeline and config.pipeline != pipeline:
        raise SnapshotError(f"config is for pipeline {config.pipeline!r}, not {pipeline!r}")
    return config


@dataclass
class RetentionGap:
    """A partition whose replay start is no longer (or not yet) in Kafka."""

    topic: str
    partition: int
    needed: int
    earliest: int
    log_end: int

    @property
    def missing(self) -> int:
        return self.earliest - self.needed if self.needed < self.earliest else self.needed - self.log_end

    def describe(self) -> str:
        if self.log_end < 0:
            return f"{self.topic}[{self.partition}]: partition no longer exists in Kafka (replay needs {self.needed})"
        if self.needed < self.earliest:
            return (f"{self.topic}[{self.partition}]: replay needs offset {self.needed} but the log starts at "
                    f"{self.earliest} ({self.missing} records deleted by retention)")
        return (f"{self.topic}[{self.partition}]: replay starts at {self.needed}, beyond the log end "
                f"{self.log_end} (topic recreated or truncated?)")


def retention_gaps(
    needed: dict[tuple[str, int], int], kafka: dict[tuple[str, int], Any]
) -> list[RetentionGap]:
    """Partitions a replay from ``needed`` cannot read in full.

    :param needed: ``{(topic, partition): next_offset}`` of the replay point; a
        partition of the topics absent here starts at 0.
    :param kafka: ``{(topic, partition): PartitionOffsets}`` (``earliest`` and
        ``high_watermark`` are used).
    """
    gaps = []
    for key in sorted(kafka):
        offsets = kafka[key]
        want = needed.get(key, 0)
        earliest = int(offsets.earliest or 0)
        end = int(offsets.high_watermark)
        if want < earliest or want > end:
            gaps.append(RetentionGap(key[0], key[1], want, earliest, end))
    for key in sorted(set(needed) - set(kafka)):
        gaps.append(RetentionGap(key[0], key[1], needed[key], 0, -1))
    return gaps
