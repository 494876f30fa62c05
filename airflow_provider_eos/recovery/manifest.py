"""A snapshot's manifest: what one snapshot holds, how a snapshot is chosen, and whether it is one
of the target database.

The manifest records, per table, the row count and checksum (``recovery.checksums``), the stored
Kafka offsets (the replay point), the dump's size and SHA-256, the app version and the identity of
the database it came from (``identity_problem``: a restore refuses a snapshot of another database).
It is written last into a snapshot's directory (``recovery.store``): no manifest, no snapshot.
Pipeline names and snapshot ids are validated here (``check_pipeline_name``, ``check_snapshot_id``),
so no path built from them leaves ``<store>/<pipeline>/<snapshot_id>``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from spark_apps.eos_stream.kafka.offsets import from_nested
from spark_apps.eos_stream.run.config_rules import PIPELINE_NAME

FORMAT_VERSION = 1
LATEST = "latest"
# ASCII digits only (\d would accept other scripts' digits); always used with fullmatch.
ID_RE = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}")


class SnapshotError(ValueError):
    """A snapshot cannot be found, read or trusted; the message says which and why."""


@dataclass
class TableState:
    """One table as it was in the snapshot.

    :param schema: schema name.
    :param table: table name.
    :param rows: row count.
    :param checksum: order-independent checksum of the rows' text (see ``recovery.checksums``).
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
    :param proof: the dump restored whole into a scratch database when the snapshot was
        taken, with every count and checksum as above (``scratch.proof_record``): the dump's
        SHA-256, the server's version and the seconds it took. Empty in manifests written
        before snapshots were proven: a restore of one proves the dump itself.
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
    proof: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def created(self) -> datetime:
        return parse_time(self.created_at)

    @property
    def total_rows(self) -> int:
        return sum(t.rows for t in self.tables)

    def offsets(self) -> dict[tuple[str, int], int]:
        """The replay point as ``{(topic, partition): next_offset}``."""
        return from_nested(self.kafka_offsets)

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


# The parts of a database's identity (``recovery.catalog.database_identity``) a restore compares.
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
    if ID_RE.fullmatch(selector):
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
    if not isinstance(snapshot_id, str) or not ID_RE.fullmatch(snapshot_id):
        raise SnapshotError(f"invalid snapshot id {snapshot_id!r}: expected YYYYMMDDTHHMMSSZ-xxxxxx")
    return snapshot_id
