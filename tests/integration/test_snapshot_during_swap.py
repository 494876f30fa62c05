"""A snapshot never races a restore's swap, against the real stack: a snapshot
started while a swap is open (complete, not yet committed) waits for it and
then dumps exactly the restored tables, never empty or half-swapped ones."""

from __future__ import annotations

import threading
import time

import pytest

from airflow_provider_eos.operators.snapshot import SnapshotOperator
from airflow_provider_eos.recovery.aside import aside_schema_name
from airflow_provider_eos.recovery.lock import swap_lock_key, target_lock_key
from airflow_provider_eos.recovery.store import DUMP, SnapshotStore
from airflow_provider_eos.recovery.swap import swap_in
from tests.integration.test_snapshot_restore import PG_BIN, PG_CONN, _damage, make_snapped, target_state

pytestmark = pytest.mark.integration

HOLD_SECONDS = 5.0  # the swap stays open this long after everything but its COMMIT ran


@pytest.fixture(scope="module")
def snapped(stack, tmp_path_factory):
    """This module's own pipeline (3000 events, 4 partitions) and one snapshot of it."""
    return make_snapped(stack, tmp_path_factory)


def _wait_for_a_waiter(hook, key: str, timeout: float = 60) -> None:
    """Returns once a session waits for the advisory lock ``key`` (after ``timeout`` at most:
    a snapshot that never waits then fails the test's assertions on its wait)."""
    deadline = time.monotonic() + timeout
    conn = hook.connect()
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            while time.monotonic() < deadline:
                cur.execute("SELECT count(*) FROM pg_locks l, (SELECT hashtextextended(%s, 0) AS k) h"
                            " WHERE l.locktype = 'advisory' AND NOT l.granted AND l.objsubid = 1"
                            " AND l.classid::int8 = (h.k >> 32) & 4294967295 AND l.objid::int8 = h.k & 4294967295",
                            (key,))
                if cur.fetchone()[0]:
                    return
                time.sleep(0.05)
    finally:
        conn.close()


def test_snapshot_during_a_swap_waits_and_sees_the_restored_tables(snapped, tmp_path) -> None:
    hook, config = snapped["hook"], snapped["config"]
    _damage(hook, config)
    damaged = target_state(hook, config)
    assert damaged != snapped["state"]
    manifest = SnapshotStore(snapped["store"]).select(config["pipeline"], "latest")
    dump = snapped["store"] / config["pipeline"] / manifest.snapshot_id / DUMP
    marks: dict[str, float] = {}
    outcome: dict[str, object] = {}
    in_swap = threading.Event()

    def hold_open() -> None:
        marks["swap_ready"] = time.monotonic()
        in_swap.set()
        # HOLD_SECONDS from when the snapshot waits for the swap's lock, not from when it was
        # started: the time its start takes (under load, seconds) is then not taken from its wait.
        _wait_for_a_waiter(hook, swap_lock_key(target_lock_key(hook.dbname, manifest.target_schema,
                                                               manifest.pipeline)))
        time.sleep(HOLD_SECONDS)

    def swap() -> None:
        try:
            outcome["swap"] = swap_in(hook, dump, manifest, aside_schema_name(config["target_schema"]),
                                      before_commit=hold_open)
        except BaseException as exc:
            outcome["swap_error"] = exc
        marks["swap_done"] = time.monotonic()

    def snapshot() -> None:
        marks["snapshot_start"] = time.monotonic()
        try:
            outcome["snapshot"] = SnapshotOperator(
                task_id="snap", pipeline_config=str(snapped["config_file"]), snapshot_store=str(tmp_path / "store"),
                postgres_conn_id=PG_CONN, keep_last=0, pg_bin_dir=PG_BIN).execute({"run_id": "during-swap"})
        except BaseException as exc:
            outcome["snapshot_error"] = exc
        marks["snapshot_done"] = time.monotonic()

    swapping = threading.Thread(target=swap)
    swapping.start()
    assert in_swap.wait(120), outcome
    taking = threading.Thread(target=snapshot)
    taking.start()
    swapping.join(180)
    taking.join(180)
    assert "swap_error" not in outcome, outcome
    assert "snapshot_error" not in outcome, outcome
    restored = target_state(hook, config)
    assert restored == snapped["state"]
    summary = outcome["snapshot"]
    assert isinstance(summary, dict)
    taken = SnapshotStore(tmp_path / "store").select(config["pipeline"], summary["snapshot_id"])
    # Neither the damaged tables, nor empty ones, nor a mix: exactly the restored state.
    assert {t.qualified: t.checksum for t in taken.tables} == restored
    assert taken.kafka_offsets == manifest.kafka_offsets
    # It really ran into the open swap and waited for its commit.
    assert marks["snapshot_start"] < marks["swap_done"] <= marks["snapshot_done"]
    waited = taken.timings["swap_lock_wait"]
    assert waited > HOLD_SECONDS - 2, taken.timings
    print(f"snapshot started {marks['snapshot_start'] - marks['swap_ready']:.2f}s into the open swap, "
          f"waited {waited:.2f}s for its commit, then dumped {taken.total_rows} rows")


_SWAP_CHILD = """
import sys, time
from airflow_provider_eos.hooks.pg_tools import PgToolsHook
from airflow_provider_eos.recovery.aside import aside_schema_name
from airflow_provider_eos.recovery.manifest import SnapshotManifest
from airflow_provider_eos.recovery.swap import swap_in

manifest = SnapshotManifest.from_json(open(sys.argv[1]).read())

def hold_open():
    print("READY", flush=True)
    time.sleep(300)

swap_in(PgToolsHook(postgres_conn_id=sys.argv[3], pg_bin_dir=sys.argv[4]),
    sys.argv[2], manifest, aside_schema_name(manifest.target_schema), drop_old=False, before_commit=hold_open)
"""


def test_worker_killed_inside_the_swap_leaves_the_old_state(snapped, tmp_path) -> None:
    """Failure transition 4: the worker dies with the swap complete but not committed."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    from airflow_provider_eos.recovery.store import MANIFEST

    hook, config = snapped["hook"], snapped["config"]
    _damage(hook, config)
    damaged = target_state(hook, config)
    manifest = SnapshotStore(snapped["store"]).select(config["pipeline"], "latest")
    folder = snapped["store"] / config["pipeline"] / manifest.snapshot_id
    env = dict(os.environ)  # the AIRFLOW_CONN_* variables the fixture exported
    worker = subprocess.Popen([sys.executable, "-c", _SWAP_CHILD, str(folder / MANIFEST), str(folder / DUMP),
                               PG_CONN, PG_BIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=Path(__file__).resolve().parents[2])
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline()
        assert line.strip() == "READY", (line, worker.stderr.read() if worker.poll() is not None else "")
        tools = psutil.Process(worker.pid).children(recursive=True)
        assert any(p.name() == "psql" for p in tools), [p.name() for p in tools]
        os.kill(worker.pid, signal.SIGKILL)  # the worker only: psql and pg_restore are left to notice
        worker.wait(30)
        _, alive = psutil.wait_procs(tools, timeout=30)
        assert not alive, alive  # psql saw EOF on its stdin and ended without COMMIT
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert target_state(hook, config) == damaged
    conn = hook.connect()
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_namespace WHERE starts_with(nspname, %s)",
                    (f"{config['target_schema'][:40]}_old_",))
        assert cur.fetchone() == (0,)
    conn.close()
