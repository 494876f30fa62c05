"""A lock that one test process at a time holds, machine-wide (the two xdist workers, and
scripts/test.sh's background dump of the Spark class archive)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path`` (created if missing) for the block. Python opens the
    descriptor non-inheritable, so daemons started inside the block (the stack's) do not hold it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
