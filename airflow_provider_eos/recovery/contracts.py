"""What each step of a recovery hands the next: one dataclass per hand-over, one serialized form.

A recovery's tasks run in different processes (often on different workers), so what one step
learned reaches the next through XCom. Each hand-over below is a frozen dataclass with
``to_xcom`` (the only serialized form: a JSON-safe dict) and ``from_xcom`` (the only reader of
it). The recovery DAG wires a step's output object into the next step's argument, so nothing
re-derives what an earlier step decided: the snapshot is chosen once, by ``choose_snapshot``,
and carried (manifest and store) to the retention check, the restore, the announcement and the
summary.

=====================  ============================  ==========================================
hand-over              made by                       read by
=====================  ============================  ==========================================
``RecoverySettings``   ``check_conf``                ``choose_snapshot``, ``finalize``
``ChosenSnapshot``     ``choose_snapshot``           ``retention_check``, ``restore``,
                                                     ``announce_recovered``, ``summary``
``Restored``           ``restore``                   ``finalize``, ``rollback``,
                                                     ``needs_rollback``, ``summary``
``Replayed``           ``replay``                    ``wait_caught_up``, ``audit``, ``summary``
=====================  ============================  ==========================================

Offsets inside them are ``{(topic, partition): offset}`` in memory and nested in XCom, converted
only by :mod:`spark_apps.eos_stream.kafka.offsets`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_provider_eos.recovery.manifest import SnapshotManifest, TableState
from spark_apps.eos_stream.kafka.offsets import Offsets, from_nested, to_nested


class ContractError(ValueError):
    """A step was handed something that is not the earlier step's output (a wiring mistake)."""


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ContractError(f"{what}: expected the earlier step's XCom (a mapping), got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class RecoverySettings:
    """The deployment's settings a recovery run pins at its start (``check_conf``), so a config
    change in the middle of a run cannot send two steps to two stores.

    :param snapshot_store: the ``[eos] snapshot_store`` the run chooses from.
    :param aside_retention_days: how long ``finalize`` keeps asides of failed recoveries.
    """

    snapshot_store: str
    aside_retention_days: float

    def to_xcom(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_xcom(cls, value: Any) -> RecoverySettings:
        data = _mapping(value, "recovery settings")
        return cls(snapshot_store=str(data["snapshot_store"]),
                   aside_retention_days=float(data["aside_retention_days"]))


@dataclass(frozen=True)
class ChosenSnapshot:
    """The one snapshot a recovery restores, as ``choose_snapshot`` chose and checked it.

    :param store: the snapshot store it was chosen from (its dump is fetched from there).
    :param manifest: the snapshot's whole manifest (tables, checksums, offsets, dump hash, proof).
    :param target_database: the database it will be restored into.
    :param table_changes: tables the snapshot lacks (``not_in_snapshot``) or holds beyond the
        pipeline's targets (``not_in_spec``), as ``[schema, table]`` pairs.
    :param dry_run: chosen by a dry run (nothing after it changes anything).
    """

    store: str
    manifest: SnapshotManifest
    target_database: str
    table_changes: dict[str, list[list[str]]] = field(default_factory=dict)
    dry_run: bool = False

    @property
    def snapshot_id(self) -> str:
        return self.manifest.snapshot_id

    @property
    def replay_point(self) -> Offsets:
        return self.manifest.offsets()

    def to_xcom(self) -> dict[str, Any]:
        # ``snapshot`` is the manifest's short form, for people reading the task's XCom.
        return {"store": self.store, "manifest": asdict(self.manifest), "snapshot": self.manifest.summary(),
                "target_database": self.target_database, "table_changes": self.table_changes,
                "dry_run": self.dry_run}

    @classmethod
    def from_xcom(cls, value: Any) -> ChosenSnapshot:
        data = _mapping(value, "chosen snapshot")
        try:
            raw = dict(data["manifest"])
            raw["tables"] = [TableState(**t) for t in raw.get("tables", [])]
            return cls(store=str(data["store"]), manifest=SnapshotManifest(**raw),
                       target_database=str(data["target_database"]),
                       table_changes={k: [list(p) for p in v] for k, v in (data.get("table_changes") or {}).items()},
                       dry_run=bool(data.get("dry_run", False)))
        except (KeyError, TypeError) as exc:
            raise ContractError(f"chosen snapshot: not a choose_snapshot output ({exc})") from exc


@dataclass(frozen=True)
class Restored:
    """What a restore did: the old tables' aside schema is what finalize drops and rollback puts back.

    :param snapshot_id: the snapshot restored.
    :param aside_schema: where the replaced tables wait (None: dropped with the swap, or a dry run).
    :param epoch: the pipeline's epoch after the swap's bump (None in a dry run).
    :param rows_restored: rows the snapshot's tables held.
    :param dry_run: a dry run planned the restore and changed nothing.
    :param details: the rest of the restore's report (per-table rows, offsets, retention at the
        swap, proof, timings), for people and the summary.
    """

    snapshot_id: str
    aside_schema: str | None = None
    epoch: int | None = None
    rows_restored: int | None = None
    dry_run: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    def to_xcom(self) -> dict[str, Any]:
        return {**self.details, "snapshot_id": self.snapshot_id, "aside_schema": self.aside_schema,
                "epoch": self.epoch, "rows_restored": self.rows_restored, "dry_run": self.dry_run}

    @classmethod
    def from_xcom(cls, value: Any) -> Restored:
        data = dict(_mapping(value, "restore result"))
        known = {k: data.pop(k, None) for k in ("snapshot_id", "aside_schema", "epoch", "rows_restored", "dry_run")}
        return cls(snapshot_id=str(known["snapshot_id"] or ""), aside_schema=known["aside_schema"] or None,
                   epoch=None if known["epoch"] is None else int(known["epoch"]),
                   rows_restored=None if known["rows_restored"] is None else int(known["rows_restored"]),
                   dry_run=bool(known["dry_run"]), details=data)


@dataclass(frozen=True)
class Replayed:
    """What a replay reached: the last stable offsets seen at its start are the goal the
    caught-up check and the audit hold the stored offsets to.

    :param lso_at_start: each partition's last stable offset when the replay started.
    :param events_replayed: rows the replay added to the pipeline's tables.
    :param dry_run: a dry run planned the replay and ran nothing.
    :param details: the rest (offsets before and after, the engine and why, retention, seconds).
    """

    lso_at_start: Offsets = field(default_factory=dict)
    events_replayed: int | None = None
    dry_run: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    def to_xcom(self) -> dict[str, Any]:
        return {**self.details, "lso_at_start": to_nested(self.lso_at_start) if not self.dry_run else None,
                "events_replayed": self.events_replayed, "dry_run": self.dry_run}

    @classmethod
    def from_xcom(cls, value: Any) -> Replayed:
        data = dict(_mapping(value, "replay result"))
        lso = data.pop("lso_at_start", None)
        events = data.pop("events_replayed", None)
        return cls(lso_at_start=from_nested(lso), events_replayed=None if events is None else int(events),
                   dry_run=bool(data.pop("dry_run", False)), details=data)
