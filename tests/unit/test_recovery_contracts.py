"""Recovery's hand-overs: each round-trips through its one serialized form, a wrong hand-over is
refused by name, and the recovery DAG wires its steps by those objects, never by XCom paths in
template strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_eos.dag_factory import pipeline_dags
from airflow_provider_eos.recovery.contracts import (
    ChosenSnapshot,
    ContractError,
    RecoverySettings,
    Replayed,
    Restored,
)
from airflow_provider_eos.recovery.manifest import SnapshotManifest, TableState
from spark_apps.eos_stream.kafka.offsets import from_nested, to_json, to_nested


def _manifest() -> SnapshotManifest:
    return SnapshotManifest(
        snapshot_id="20261127T080000Z-abcdef", created_at="2026-11-27T08:00:00+00:00", pipeline="alpha",
        database="eos", target_schema="t_alpha", meta_schema="m_alpha",
        tables=[TableState("t_alpha", "events", 3, "c1"), TableState("m_alpha", "offsets", 2, "c2", role="meta")],
        kafka_offsets={"alpha.events": {"0": 7, "1": 9}}, dump_sha256="f" * 64)


def test_offsets_have_one_converter_both_ways() -> None:
    flat = {("b", 10): 3, ("b", 2): 5, ("a", 0): 1}
    nested = to_nested(flat)
    assert nested == {"a": {"0": 1}, "b": {"2": 5, "10": 3}}
    assert list(nested["b"]) == ["2", "10"]  # partitions in numeric order
    assert from_nested(json.loads(json.dumps(nested))) == flat  # through JSON, keys as strings
    assert from_nested({"a": {0: "4"}}) == {("a", 0): 4}
    assert from_nested(None) == {}
    assert json.loads(to_json(flat)) == nested
    with pytest.raises(ValueError):
        from_nested({"a": {"zero": 1}})


def test_each_hand_over_round_trips_through_json() -> None:
    settings = RecoverySettings(snapshot_store="/srv/snapshots", aside_retention_days=7.0)
    chosen = ChosenSnapshot(store="/srv/snapshots", manifest=_manifest(), target_database="eos",
                            table_changes={"not_in_snapshot": [["t_alpha", "new"]], "not_in_spec": []})
    restored = Restored("20261127T080000Z-abcdef", aside_schema="t_alpha_old_20261127T080500", epoch=4,
                        rows_restored=5, details={"timings": {"total": 1.5}})
    replayed = Replayed(lso_at_start={("alpha.events", 0): 12, ("alpha.events", 1): 9}, events_replayed=5,
                        details={"engine": {"engine": "direct"}})
    for value in (settings, chosen, restored, replayed):
        wire = json.loads(json.dumps(value.to_xcom()))
        assert type(value).from_xcom(wire) == value, type(value).__name__
    assert ChosenSnapshot.from_xcom(chosen.to_xcom()).replay_point == {("alpha.events", 0): 7, ("alpha.events", 1): 9}
    # A step's report keeps what people read, beside the typed fields.
    assert restored.to_xcom()["timings"] == {"total": 1.5}
    assert replayed.to_xcom()["lso_at_start"] == {"alpha.events": {"0": 12, "1": 9}}


def test_a_wrong_hand_over_is_refused_by_name() -> None:
    with pytest.raises(ContractError, match="chosen snapshot"):
        ChosenSnapshot.from_xcom({"snapshot": {"snapshot_id": "x"}})  # the old summary-only shape
    with pytest.raises(ContractError, match="replay result"):
        Replayed.from_xcom("{{ ti.xcom_pull(task_ids='replay') }}")
    with pytest.raises(ContractError, match="restore result"):
        Restored.from_xcom(None)


def _templated_strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _templated_strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _templated_strings(v)]
    return []


def test_the_recovery_dag_wires_steps_by_their_outputs(tmp_path: Path) -> None:
    (tmp_path / "alpha.yaml").write_text(json.dumps({
        "name": "alpha", "topics": ["alpha.events"], "spec": "spark_apps.ledger.spec:LEDGER",
        "target_schema": "t_alpha", "meta_schema": "m_alpha", "checkpoint_dir": "/tmp/cp/alpha"}))
    dag = pipeline_dags(tmp_path)["eos_recovery__alpha"]
    for task in dag.tasks:
        for name in task.template_fields:
            for text in _templated_strings(getattr(task, name, None)):
                assert "xcom_pull" not in text, (task.task_id, name, text)
    choose = dag.get_task("choose_snapshot")
    # The snapshot is chosen once: later steps are handed the choice, not a selector to choose again.
    for step in ("retention_check", "restore"):
        assert dag.get_task(step).snapshot.operator is choose, step
    replay = dag.get_task("replay")
    for step in ("wait_caught_up", "audit"):
        assert dag.get_task(step).replayed.operator is replay, step
    restore = dag.get_task("restore")
    for step in ("finalize", "rollback"):
        assert dag.get_task(step).restored.operator is restore, step
