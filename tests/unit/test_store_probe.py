"""``eos preflight``'s snapshot-store check: the store is there (created as a snapshot would) and
takes a file; a root others could write to, or one this user cannot write, fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from airflow_provider_eos.recovery.store import SnapshotError, SnapshotStore


def test_a_missing_local_root_is_created_private_and_proven_writable(tmp_path: Path) -> None:
    root = tmp_path / "store"
    directory, created = SnapshotStore(str(root)).probe("payments")
    assert created and directory == root / "payments" and list(directory.iterdir()) == []
    assert (os.stat(root).st_mode & 0o777, os.stat(directory).st_mode & 0o777) == (0o700, 0o700)
    assert SnapshotStore(str(root)).probe("payments") == (directory, False)


def test_a_root_others_can_write_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o775)
    with pytest.raises(SnapshotError, match="lets its group write to it"):
        SnapshotStore(str(root)).probe("payments")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any mode")
def test_a_root_this_user_cannot_write_fails(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o500)
    try:
        with pytest.raises(PermissionError):
            SnapshotStore(str(root)).probe("payments")
    finally:
        os.chmod(root, 0o700)
