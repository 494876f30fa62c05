"""The continuous engine's end on request (C7, C9): the SIGTERM flag, and the waits between
retries, which end as soon as a SIGTERM, a stop request or a changed epoch comes."""

from __future__ import annotations

import signal
import time
from typing import Any

from spark_apps.eos_stream.engines.shared import poll_stop
from spark_apps.eos_stream.state.control import StopSignal

# C9: the stop reasons a SIGTERM gives, and the exit code it ends with (128 + SIGTERM, as a shell
# reports a process the signal ended).
TERMINATED = "SIGTERM: ended after the cycle in flight"
TERMINATED_MID_CYCLE = "SIGTERM: ended in a cycle's retry, the cycle uncommitted"
EXIT_TERMINATED = 128 + signal.SIGTERM
# How often a retry's wait looks at the SIGTERM flag.
_WAIT_SLICE_SECONDS = 0.05


class Interrupted(BaseException):
    """The run was asked to end (C7, C9) while a cycle waited to retry: the cycle's failed
    attempt has rolled back. A BaseException, so that no ``except Exception`` retries it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Waits:
    """The SIGTERM flag, and the waits between retries (the claim's, a cycle's), which end
    early on a SIGTERM, a stop request or a changed epoch (``stop``, once the run has one)."""

    def __init__(self, poll_seconds: float) -> None:
        self.poll_seconds = poll_seconds
        self.terminated = False
        self.stop: StopSignal | None = None

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.terminated = True

    def pause(self, seconds: float) -> None:
        """Sleeps ``seconds``, or raises ``Interrupted`` (``Fenced``) as soon as asked to end."""
        end, polled = time.monotonic() + seconds, None
        while True:
            if self.terminated:
                raise Interrupted(TERMINATED_MID_CYCLE)
            now = time.monotonic()
            if self.stop is not None and (polled is None or now - polled >= self.poll_seconds):
                polled = now
                reason = poll_stop(self.stop)
                if reason:
                    raise Interrupted(reason)
            if now >= end:
                return
            time.sleep(min(end - now, _WAIT_SLICE_SECONDS))
