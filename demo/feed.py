"""A background producer that keeps committing while something else happens (a stream crashes,
a recovery runs), so what is claimed of a live topic is shown on a live topic."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Feed(threading.Thread):
    """Calls ``produce(tick)`` every ``interval`` seconds until stopped; ``stop`` returns what each
    call returned, and raises if a call failed (a run must not claim a feed that died).

    :param produce: one tick's production (for example a ``produce_ledger`` call: one or a few
        Kafka transactions); reuse one transactional id, so each call fences the previous one.
    :param interval: seconds between two ticks.
    """

    def __init__(self, produce: Callable[[int], Any], interval: float = 2.0, name: str = "feed") -> None:
        super().__init__(daemon=True, name=name)
        self.produce, self.interval = produce, interval
        self.summaries: list[Any] = []
        self.error: BaseException | None = None
        self.stop_event = threading.Event()

    def run(self) -> None:
        tick = 0
        while not self.stop_event.wait(self.interval):
            tick += 1
            try:
                self.summaries.append(self.produce(tick))
            except Exception as exc:  # reported by stop()
                self.error = exc
                return

    def stop(self) -> list[Any]:
        self.stop_event.set()
        self.join(60)
        if self.error is not None:
            raise RuntimeError(f"the {self.name} failed: {self.error}") from self.error
        return self.summaries
