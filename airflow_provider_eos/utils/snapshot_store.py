"""Snapshots of a pipeline's database state: the manifest model and the store.

A snapshot is a marker and two files in ``<store>/<pipeline>/<snapshot_id>/``:

``.eos-snapshot``
    written first, when the store creates the directory: retention deletes
    only directories that carry it (or a manifest), an id-shaped name and no
    symlink, so nothing else found in the store is ever deleted;

``dump.pgc``
    one ``pg_dump -Fc`` of the pipeline's target tables and its bookkeeping
    tables, taken from one exported snapshot (so the data and the Kafka
    offsets stored beside it are from the same instant);
``manifest.json``
    what is in the dump: row count and checksum per table, the stored Kafka
    offsets (the replay point), the dump's size and SHA-256, the app version.

The manifest is written last (locally: aside, then renamed): a directory
without one is an unfinished snapshot and is ignored (and removed by
retention). The store is a local directory or any
:class:`airflow.sdk.ObjectStoragePath` (``s3://``, ``gs://``, ``file://`` ...);
nothing here talks to PostgreSQL or Kafka.

Pipeline names (the app's ``PIPELINE_NAME``: a letter or digit first, so never
``.``, ``..`` or hidden) and snapshot ids are validated on every path
operation, so no caller can read, write or delete outside
``<store>/<pipeline>/<snapshot_id>``. A local store creates its directories
0700 and its files 0600 whatever the umask (dumps hold the pipeline's data),
refuses symlinked pipeline or snapshot directories, and refuses a root that
another user owns or that group or others may write to (``check_store_root``):
the store is a trust boundary, whatever lies in it a restore loads into the
target database. An object store's access is its bucket policy's business.
Each manifest records the identity of the database it came from
(``identity_problem``): a restore refuses a snapshot of another database.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

from spark_apps.eos_stream.config import PIPELINE_NAME

MANIFEST = "manifest.json"
DUMP = "dump.pgc"
# Written first into every snapshot directory the store creates: retention deletes
# only directories that carry it (or a manifest), never anything else it finds.
MARKER = ".eos-snapshot"
_MANIFEST_TMP = MANIFEST + ".tmp"
FORMAT_VERSION = 1
LATEST = "latest"
# ASCII digits only (\d would accept other scripts' digits); always used with fullmatch.
_ID_RE = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}")
DIR_MODE = 0o700
FILE_MODE = 0o600

log = logging.getLogger(__name__)


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
    :param identity: which database the dump came from (``database_identity``): its
        name, its OID and the cluster's ``system_identifier``. A restore refuses a
        manifest whose identity is not the target's. Empty in manifests written
        before it was recorded: those are checked by ``database`` alone.
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
    identity: dict[str, str] = field(default_factory=dict)
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


# The parts of a database's identity (PgToolsHook.database_identity) a restore compares.
IDENTITY_KEYS = ("database", "database_oid", "system_identifier")


def identity_problem(manifest: SnapshotManifest, target: dict[str, str]) -> str | None:
    """Why ``manifest`` is not a snapshot of the ``target`` database (its
    ``database_identity``), or None when it is.

    A manifest with an identity must match the target on every part both know: the
    database name, its OID (a database dropped and created again under the same name
    is another one) and the cluster's ``system_identifier`` (the same name on another
    cluster: a staging copy, a restored backup's new cluster, or the same cluster after
    ``pg_upgrade``, which initializes a new one). A manifest written before identities
    were recorded is checked by its database name only: the name is all it holds, and a
    store that anyone but its owner could write to is refused anyway (``SnapshotStore``),
    so the check guards against a wrong store or connection, not against a forger.
    """
    recorded = {key: str(value) for key, value in (manifest.identity or {}).items() if value not in (None, "")}
    recorded.setdefault("database", manifest.database)
    differs = [f"{key} {recorded[key]!r} (the target's is {target[key]!r})" for key in IDENTITY_KEYS
               if key in recorded and target.get(key) not in (None, "") and recorded[key] != str(target[key])]
    if not differs:
        return None
    return (f"snapshot {manifest.snapshot_id} is of another database: its " + ", ".join(differs)
            + ". Restoring it would replace this database's tables with another database's. Choose a snapshot "
            "of this database, or, if it really is this database under a new identity (after pg_upgrade or a "
            "restore into a new cluster), set allow_other_database")


def check_store_root(root: Path) -> None:
    """Refuses a local store whose root (or a directory above it) others could write to.

    A restore loads whatever dump the store holds into the target database: anyone who
    can create or replace entries under the root can plant a snapshot. So the root must
    belong to this process's user and be writable by it alone (no group or world write
    bit), and every directory above it must not be writable by group or others unless it
    has the sticky bit (like /tmp, where only an entry's owner may rename or delete it).
    A root that does not exist yet is created private by ``save``.

    :raises SnapshotError: naming the path and how to fix it.
    """
    try:
        info = os.stat(root)
    except FileNotFoundError:
        return
    problems = []
    uid = os.geteuid()
    if info.st_uid != uid:
        problems.append(f"it is owned by uid {info.st_uid}, not by this process's user (uid {uid})")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        writers = " and ".join(w for bit, w in ((0o020, "its group"), (0o002, "every user")) if mode & bit)
        problems.append(f"its mode {mode:04o} lets {writers} write to it")
    if problems:
        raise SnapshotError(
            f"refusing snapshot store {root}: " + "; ".join(problems) + ". Whoever can write there can plant a "
            "snapshot that a restore loads into the target database. Fix: "
            + (f"chown {uid} {root} (as its owner or root), then " if info.st_uid != uid else "")
            + f"chmod go-w {root} (or chmod 700 {root}), or point [eos] snapshot_store at a private directory"
        )
    for parent in Path(os.path.abspath(root)).parents:
        try:
            above = os.stat(parent)
        except OSError:
            continue
        if stat.S_IMODE(above.st_mode) & 0o022 and not above.st_mode & stat.S_ISVTX:
            raise SnapshotError(
                f"refusing snapshot store {root}: {parent} above it (mode {stat.S_IMODE(above.st_mode):04o}) lets "
                f"others than its owner write to it, so they could replace the store. Fix: chmod go-w {parent}, "
                "or move the store under a directory only its owner can write to"
            )


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
    if _ID_RE.fullmatch(selector):
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


def check_pipeline_name(pipeline: Any) -> str:
    """``pipeline`` if it is a valid pipeline name (one path component, a letter or
    digit first: never ``.``, ``..``, a hidden name or a path).

    :raises SnapshotError: it is not.
    """
    if not isinstance(pipeline, str) or not PIPELINE_NAME.fullmatch(pipeline):
        raise SnapshotError(
            f"invalid pipeline name {pipeline!r}: expected {PIPELINE_NAME.pattern} (a letter or digit first)"
        )
    return pipeline


def check_snapshot_id(snapshot_id: Any) -> str:
    """``snapshot_id`` if it is a snapshot id (``YYYYMMDDTHHMMSSZ-xxxxxx``).

    :raises SnapshotError: it is not.
    """
    if not isinstance(snapshot_id, str) or not _ID_RE.fullmatch(snapshot_id):
        raise SnapshotError(f"invalid snapshot id {snapshot_id!r}: expected YYYYMMDDTHHMMSSZ-xxxxxx")
    return snapshot_id


def _local_root(base: Any) -> Path | None:
    """The local directory behind ``base`` (a Path, or a ``file://`` ObjectStoragePath)."""
    if isinstance(base, Path):
        return base
    if getattr(base, "protocol", None) in ("file", "local"):
        return Path(base.path)
    return None


def _is_symlink(path: Any) -> bool:
    try:
        return bool(path.is_symlink())
    except (AttributeError, NotImplementedError, OSError):
        return False  # object stores have no symlinks


def _open_private(path: Path, exclusive: bool = True) -> BinaryIO:
    """A new local file, mode 0600 whatever the umask, never through a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, FILE_MODE)
    try:
        # The umask can only take bits away from FILE_MODE; fchmod pins it exactly.
        os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


class SnapshotStore:
    """Snapshots on a local directory or an ObjectStoragePath.

    Every path operation validates the pipeline name (``PIPELINE_NAME`` of the
    app's config) and the snapshot id, so nothing outside ``<base>/<pipeline>/<id>``
    is read, written or deleted. A local store (a path or ``file://``) creates its
    directories with mode 0700 and its files with mode 0600, whatever the umask,
    and refuses symlinked pipeline or snapshot directories. Retention deletes only
    directories the store created: an id-shaped name, a real directory, and the
    store's marker or manifest inside.

    :param base: root of the store: a local path, a URL (``s3://bucket/eos``,
        with ``conn_id`` in the URL's user part as Airflow allows) or an
        ObjectStoragePath.
    """

    def __init__(self, base: Any) -> None:
        self.base = _as_path(base)
        self._local = _local_root(self.base)
        self._root: Any = self._local if self._local is not None else self.base

    def __repr__(self) -> str:
        return f"SnapshotStore({str(self.base)!r})"

    def _dir(self, pipeline: str, snapshot_id: str | None = None) -> Any:
        if self._local is not None:
            check_store_root(self._local)  # every read and write: the store is a trust boundary
        path = self._root / check_pipeline_name(pipeline)
        if self._local is not None and _is_symlink(path):
            raise SnapshotError(f"refusing {path}: the pipeline directory is a symlink")
        if snapshot_id is None:
            return path
        path = path / check_snapshot_id(snapshot_id)
        if self._local is not None and _is_symlink(path):
            raise SnapshotError(f"refusing {path}: the snapshot directory is a symlink")
        return path

    def _own_dirs(self, pipeline: str) -> Iterator[Any]:
        """Snapshot directories of ``pipeline`` this store created (see :meth:`owns`)."""
        root = self._dir(pipeline)
        if not root.exists():
            return
        for child in root.iterdir():
            if self.owns(child):
                yield child

    def owns(self, path: Any) -> bool:
        """True for a directory the store created: an id-shaped name, not a symlink,
        with the store's marker or a manifest in it."""
        if not _ID_RE.fullmatch(path.name) or _is_symlink(path) or not path.is_dir():
            return False
        return any((path / name).exists() and not _is_symlink(path / name) for name in (MARKER, MANIFEST))

    def dump_path(self, manifest: SnapshotManifest) -> Any:
        return self._dir(manifest.pipeline, manifest.snapshot_id) / DUMP

    def manifests(self, pipeline: str) -> list[SnapshotManifest]:
        """Complete snapshots of ``pipeline``, oldest first. Unreadable manifests,
        and manifests that name another id or pipeline than where they lie, are
        skipped (select() then cannot pick them)."""
        out = []
        for child in self._own_dirs(pipeline):
            manifest_path = child / MANIFEST
            if not manifest_path.exists() or _is_symlink(manifest_path):
                continue
            try:
                manifest = SnapshotManifest.from_json(manifest_path.read_text())
            except SnapshotError:
                continue
            if manifest.snapshot_id != child.name or manifest.pipeline != pipeline:
                log.warning("ignoring %s: its manifest names snapshot %r of pipeline %r", child,
                            manifest.snapshot_id, manifest.pipeline)
                continue
            out.append(manifest)
        return sorted(out, key=lambda m: (m.created, m.snapshot_id))

    def incomplete(self, pipeline: str) -> list[str]:
        """Snapshot directories the store created that have no manifest (an interrupted snapshot)."""
        return sorted(c.name for c in self._own_dirs(pipeline) if not (c / MANIFEST).exists())

    def select(self, pipeline: str, selector: str) -> SnapshotManifest:
        return select(self.manifests(pipeline), selector)

    def save(self, manifest: SnapshotManifest, dump_file: str | Path) -> Any:
        """Marks a new directory as the store's, copies the dump in, then writes the
        manifest (the commit point)."""
        target = self._dir(manifest.pipeline, manifest.snapshot_id)
        if self._local is None:
            target.mkdir(parents=True, exist_ok=True)
            (target / MARKER).write_text(manifest.snapshot_id)
            with open(dump_file, "rb") as src, (target / DUMP).open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            (target / MANIFEST).write_text(manifest.to_json())
            return target
        self._private_dir(self._local, create_parents=True)
        check_store_root(self._local)  # created just now, or checked by _dir already
        self._private_dir(target.parent)
        try:
            os.mkdir(target, DIR_MODE)
        except FileExistsError as exc:
            raise SnapshotError(f"snapshot directory {target} already exists") from exc
        os.chmod(target, DIR_MODE)
        with _open_private(target / MARKER) as marker:
            marker.write(manifest.snapshot_id.encode())
        with open(dump_file, "rb") as src, _open_private(target / DUMP) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        # Written aside and renamed: a manifest is either absent or complete.
        with _open_private(target / _MANIFEST_TMP) as out:
            out.write(manifest.to_json().encode())
        os.replace(target / _MANIFEST_TMP, target / MANIFEST)
        return target

    def _private_dir(self, path: Path, create_parents: bool = False) -> None:
        """Creates ``path`` with mode 0700. The store's root keeps the mode it has if
        it already exists (the deployment chose it, and ``check_store_root`` refuses
        one that others can write to); a pipeline directory is the store's own and is
        set to 0700."""
        if _is_symlink(path) and path != self._local:
            raise SnapshotError(f"refusing {path}: it is a symlink")
        if path.is_dir():
            if path != self._local:
                os.chmod(path, DIR_MODE)
            return
        if create_parents:
            # Missing parents as 0755 whatever the umask: a parent others may write to would let
            # them replace the store (check_store_root refuses that).
            for parent in reversed([p for p in path.parents if not p.exists()]):
                try:
                    os.mkdir(parent, 0o755)
                except FileExistsError:
                    continue  # a concurrent save created it
                os.chmod(parent, 0o755)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass  # a concurrent save created it
        os.chmod(path, DIR_MODE)

    def fetch_dump(self, manifest: SnapshotManifest, local_file: str | Path) -> Path:
        """Copies the dump to a local file (mode 0600) and checks its SHA-256 against the manifest."""
        source = self.dump_path(manifest)
        if not source.exists():
            raise SnapshotError(f"snapshot {manifest.snapshot_id}: dump file {source} is missing")
        if self._local is not None and _is_symlink(source):
            raise SnapshotError(f"snapshot {manifest.snapshot_id}: dump file {source} is a symlink")
        local = Path(local_file)
        with source.open("rb") as src, _open_private(local, exclusive=False) as dst:
            _copy(src, dst)
        digest = sha256_file(local)
        if manifest.dump_sha256 and digest != manifest.dump_sha256:
            raise SnapshotError(
                f"snapshot {manifest.snapshot_id}: dump file is corrupted (sha256 {digest[:12]}... "
                f"!= manifest {manifest.dump_sha256[:12]}...)"
            )
        return local

    def delete(self, pipeline: str, snapshot_id: str) -> None:
        """Removes one snapshot the store created: the manifest first, so a
        half-deleted one is never selected, the marker last, so it stays
        recognisable as the store's until it is gone.

        :raises SnapshotError: the directory is not the store's, or holds files
            the store did not write (then nothing in it is deleted).
        """
        target = self._dir(pipeline, snapshot_id)
        if not target.exists():
            return
        if not self.owns(target):
            raise SnapshotError(f"not deleting {target}: the store did not create it (no {MARKER} or {MANIFEST})")
        ours = (MANIFEST, _MANIFEST_TMP, DUMP, MARKER)
        foreign = sorted(child.name for child in target.iterdir() if child.name not in ours)
        if foreign:
            # Checked before deleting anything: the snapshot stays whole and selectable.
            raise SnapshotError(f"not deleting {target}: it holds entries the store did not write: {foreign}")
        for name in ours:
            path = target / name
            if _is_symlink(path) or path.exists():
                path.unlink()
        target.rmdir()

    def apply_retention(self, pipeline: str, keep_last: int) -> list[str]:
        """Keeps the newest ``keep_last`` complete snapshots; returns deleted ids.

        Incomplete snapshot directories older than the oldest kept snapshot go
        too. Only directories the store created are touched (:meth:`owns`);
        one that cannot be deleted cleanly is logged and left for the next run."""
        manifests = self.manifests(pipeline)
        doomed = retention_plan(manifests, keep_last)
        kept = [m.snapshot_id for m in manifests if m not in doomed]
        candidates = [m.snapshot_id for m in doomed]
        if kept:
            candidates += [name for name in self.incomplete(pipeline) if name < kept[0]]
        deleted = []
        for snapshot_id in candidates:
            try:
                self.delete(pipeline, snapshot_id)
            except SnapshotError as exc:
                log.warning("retention: %s", exc)
                continue
            deleted.append(snapshot_id)
        return deleted


def _copy(src: BinaryIO, dst: BinaryIO) -> None:
    shutil.copyfileobj(src, dst, 1 << 20)


# ---------------------------------------------------------------------- replay checks
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
