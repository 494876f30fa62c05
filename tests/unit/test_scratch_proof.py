"""When a restore may trust the proof a snapshot recorded when it was taken (``recovery.scratch``)."""

from __future__ import annotations

import pytest

from airflow_provider_eos.recovery.manifest import SnapshotManifest
from airflow_provider_eos.recovery.scratch import proof_record, trusted_proof

SHA = "ab" * 32


def _manifest(proof: dict | None = None, sha: str = SHA) -> SnapshotManifest:
    return SnapshotManifest(snapshot_id="20261127T000000Z-abcdef", created_at="2026-11-27T00:00:00+00:00",
                            pipeline="p", database="eos", target_schema="t", meta_schema="m", dump_sha256=sha,
                            proof=proof or {})


def _proven(version_num: int = 150018) -> dict:
    return proof_record(_manifest(), {"server_version": "15.18 (Debian 15.18-0+deb12u1)",
                                      "server_version_num": version_num, "restore_seconds": 1.0,
                                      "validate_seconds": 0.5})


def test_a_proof_of_the_same_dump_on_the_same_major_version_is_trusted() -> None:
    assert trusted_proof(_manifest(_proven()), 150018) == (
        "proven when taken, on PostgreSQL 15.18 (Debian 15.18-0+deb12u1)")
    assert trusted_proof(_manifest(_proven(150004)), 150018) is not None  # a minor upgrade restores alike


@pytest.mark.parametrize(("manifest", "server"), [
    (_manifest(), 150018),  # taken before proofs were recorded
    (_manifest(_proven(), sha="cd" * 32), 150018),  # a proof of another file
    (_manifest(_proven(), sha=""), 150018),  # no checksum to tie the proof to the file
    (_manifest(_proven()), 160002),  # after a major upgrade pg_restore may make another thing of it
    (_manifest({**_proven(), "server_version_num": 0}), 150018),
])
def test_the_restore_proves_the_dump_itself_otherwise(manifest: SnapshotManifest, server: int) -> None:
    assert trusted_proof(manifest, server) is None


def test_the_proof_survives_the_manifest_round_trip_and_old_manifests_read_without_one() -> None:
    import json

    manifest = _manifest(_proven())
    assert SnapshotManifest.from_json(manifest.to_json()).proof == manifest.proof
    written_before_proofs = json.loads(manifest.to_json())
    del written_before_proofs["proof"]
    old = SnapshotManifest.from_json(json.dumps(written_before_proofs))
    assert old.proof == {} and trusted_proof(old, 150018) is None
