"""Faults of the local stack in real-stack tests: a daemon SIGKILLed by the PID in its pid file
under the stack's state directory, then started again by scripts/stack.sh; PostgreSQL restarted
in immediate mode (a crash: no shutdown checkpoint, every client cut at once)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demo.env_files import STATE_DIR

ROOT = Path(__file__).resolve().parents[2]
STACK_SH = ROOT / "scripts" / "stack.sh"
CONNECT_PID = STATE_DIR / "connect" / "connect.pid"
KAFKA_PID = STATE_DIR / "kafka" / "kafka.pid"


@dataclass(frozen=True)
class Restart:
    """A daemon killed and started again: its PID before and after, and the seconds it was down."""

    killed: int
    started: int
    down_seconds: float


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def gone(pid: int) -> bool:
    """Whether ``pid`` is reaped: stack.sh's ``kill -0`` still finds a zombie, and takes it for
    the running daemon."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def stack_sh(*args: str, timeout: float = 300) -> None:
    """``scripts/stack.sh *args``; ``timeout`` outlasts its own wait for the broker (240 s by default)."""
    subprocess.run(["bash", str(STACK_SH), *args], check=True, timeout=timeout, stdout=subprocess.DEVNULL)


def kill_and_restart(pid_file: Path, *start: str) -> Restart:
    """SIGKILLs the PID in ``pid_file``, waits until it is gone, and runs ``stack.sh *start``."""
    killed = int(pid_file.read_text().strip())
    assert alive(killed), f"{pid_file} names {killed}, which does not run"
    began = time.monotonic()
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not gone(killed):  # the daemon's parent is init, which reaps it in its own time
        assert time.monotonic() < deadline, f"{killed} still there 120 s after SIGKILL (alive: {alive(killed)})"
        time.sleep(0.1)
    stack_sh(*start)
    started = int(pid_file.read_text().strip())
    assert started != killed and alive(started), (killed, started)
    return Restart(killed, started, time.monotonic() - began)


def kill_connect_worker() -> Restart:
    """The Kafka Connect worker SIGKILLed, then ``stack.sh start-connect``."""
    return kill_and_restart(CONNECT_PID, "start-connect")


def kill_broker() -> Restart:
    """The Kafka broker SIGKILLed, then ``stack.sh start`` (it starts what is not running)."""
    return kill_and_restart(KAFKA_PID, "start")


def postmaster_started(conn: Any) -> Any:
    with conn.cursor() as cur:
        cur.execute("SELECT pg_postmaster_start_time()")
        return cur.fetchone()[0]


def restart_postgres_immediate(connect: Any) -> Restart:
    """``stack.sh restart-postgres-immediate``; ``connect()`` opens a connection to the cluster,
    before (to see the server's start time) and after (to see a new one)."""
    conn = connect()
    try:
        before = postmaster_started(conn)
    finally:
        conn.close()
    began = time.monotonic()
    stack_sh("restart-postgres-immediate")
    conn = connect()
    try:
        after = postmaster_started(conn)
    finally:
        conn.close()
    assert after > before, (before, after)
    return Restart(int(before.timestamp()), int(after.timestamp()), time.monotonic() - began)
