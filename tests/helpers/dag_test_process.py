"""``dag.test()`` in an interpreter of its own, ended cleanly.

Airflow's OpenLineage listener sends a DAG run's events from a process pool it forks inside
``dag.test()``. An interpreter's exit waits for those workers, and a worker forked while another
thread held a lock never ends: the exit then hangs, after every result was printed (seen in CI,
and found here with gdb: a pool worker reading its own queue's pipe, orphaned, holding the
test's stdout). So a script leaves with ``os._exit`` once its results are out, and the harness
ends whatever the interpreter left in its process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

# The last lines of every dag.test() script: its results are printed, nothing else is waited for.
EXIT_AFTER_RESULTS = """
import os as _os, sys as _sys
_sys.stdout.flush()
_sys.stderr.flush()
_os._exit(0)
"""


def end_process_group(process: subprocess.Popen) -> None:
    """SIGKILLs what is left of ``process``'s group (its own session): the pool workers it forked."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
