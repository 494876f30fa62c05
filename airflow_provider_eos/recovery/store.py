"""The snapshot store: where snapshots lie, who may write there, and what retention deletes.

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
(``recovery.manifest.identity_problem``): a restore refuses a snapshot of another database.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from airflow_provider_eos.recovery.manifest import (
    ID_RE,
    SnapshotError,
    SnapshotManifest,
    check_pipeline_name,
    check_snapshot_id,
    select,
)

MANIFEST = "manifest.json"
DUMP = "dump.pgc"
# Written first into every snapshot directory the store creates: retention deletes
# only directories that carry it (or a manifest), never anything else it finds.
MARKER = ".eos-snapshot"
_MANIFEST_TMP = MANIFEST + ".tmp"
DIR_MODE = 0o700
FILE_MODE = 0o600

log = logging.getLogger(__name__)


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
        if not ID_RE.fullmatch(path.name) or _is_symlink(path) or not path.is_dir():
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

    def probe(self, pipeline: str) -> tuple[Any, bool]:
        """Proves the store takes this pipeline's snapshots: creates the local root and the
        pipeline's directory as ``save`` does, writes a file there and deletes it (on an object
        store the write proves the bucket is there and writable).

        :return: (the pipeline's directory, whether the local root was created just now).
        :raises SnapshotError: others could write to the root (``check_store_root``).
        :raises OSError: the store refused the write."""
        created = self._local is not None and not self._local.is_dir()
        if self._local is not None:
            self._private_dir(self._local, create_parents=True)
        directory = self._dir(pipeline)
        probe = directory / f".eos-probe-{os.getpid()}"
        if self._local is None:
            directory.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
        else:
            self._private_dir(directory)
            _open_private(probe).close()
        probe.unlink()
        return directory, created

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

