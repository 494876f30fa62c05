"""What every launcher reports: the app's ``EOS-`` lines parsed, and how a run ended.

Exit codes and event kinds are the app's (``spark_apps.eos_stream.run.entry``), for every engine."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from typing import Any

from spark_apps.eos_stream.kafka.lost_data import DATA_LOST_KIND, EXIT_DATA_LOST

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
# The app's exit when the database fenced it (``spark_apps.eos_stream.state.fencing.EXIT_FENCED``; not
# imported: this module must load without the app's psycopg2-based modules on the import path).
EXIT_FENCED = 3
# The exit of a run that found a stored offset Kafka no longer holds (retention deleted the
# records, or the topic was recreated): no restart can succeed. The app reports it with this
# exit, or with an ``EOS-ERROR`` line of kind ``data_lost`` (its message names each partition,
# the stored offset and the log's start): ``EXIT_DATA_LOST`` and ``DATA_LOST_KIND``, imported above
# from the app's module that defines them (it needs nothing but the standard library).
EVENT_PREFIX = "EOS-"
_JSON = json.JSONDecoder()

Event = tuple[str, dict[str, Any]]


def parse_event(line: str) -> Event | None:
    """``EOS-BATCH {...}`` -> ("batch", {...}); None for any other line.

    Anything after the JSON value is ignored: another process writing to the
    same pipe (the driver's JVM logs on stderr) can glue its output to the line."""
    if not line.startswith(EVENT_PREFIX):
        return None
    kind, _, payload = line[len(EVENT_PREFIX):].partition(" ")
    try:
        data = _JSON.raw_decode(payload.lstrip())[0] if payload.strip() else {}
    except json.JSONDecodeError:
        return None
    return kind.lower(), data if isinstance(data, dict) else {"value": data}


@dataclass
class EventLog:
    """The events of one run, in order. With ``fold_batches`` a batch's event is folded into the
    previous batch's (its counts summed, its end offsets kept, ``folded_batches`` counting them),
    so a continuous run of weeks at tens of cycles a second holds one batch event, not millions."""

    fold_batches: bool = False
    events: list[Event] = field(default_factory=list)

    def add(self, event: Event) -> None:
        kind, data = event
        last = self.events[-1] if self.events else None
        if not self.fold_batches:
            self.events.append(event)
        elif kind != "batch" or last is None or last[0] != "batch":
            self.events.append((kind, {**data, "folded_batches": 1} if kind == "batch" else data))
        else:
            folded = last[1]
            self.events[-1] = (kind, {**data, "folded_batches": int(folded.get("folded_batches", 1)) + 1,
                                      **{key: int(folded.get(key) or 0) + int(data.get(key) or 0)
                                         for key in ("applied", "dead_lettered")}})


@dataclass
class AppRunResult:
    """How one run of an engine ended.

    :param returncode: the run's exit status (negative: killed by that signal).
    :param events: parsed ``EOS-`` lines, in order, as (kind, payload).
    """

    returncode: int
    events: list[Event] = field(default_factory=list)
    duration_s: float = 0.0
    log_tail: str = ""

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [data for k, data in self.events if k == kind]

    @property
    def ok(self) -> bool:
        """The run finished, or stopped on request or at its time."""
        return self.returncode == EXIT_OK

    @property
    def last_error(self) -> dict[str, Any] | None:
        errors = self.of("error")
        return errors[-1] if errors else None

    @property
    def config_error(self) -> bool:
        error = self.last_error
        return self.returncode == EXIT_CONFIG or bool(error and error.get("kind") == "config")

    @property
    def fenced(self) -> bool:
        """The database took the target away from this driver (a newer driver, a restore, a
        fence): it wrote nothing after that, and a restart must begin from the stored offsets."""
        error = self.last_error
        return self.returncode == EXIT_FENCED or bool(
            self.returncode != EXIT_OK and error and error.get("kind") == "fenced")

    @property
    def data_lost(self) -> bool:
        """The run found a stored offset that Kafka no longer holds: a retry would fail the same way."""
        error = self.last_error
        return self.returncode == EXIT_DATA_LOST or bool(
            self.returncode != EXIT_OK and error and error.get("kind") == DATA_LOST_KIND)

    def reason(self) -> str:
        """One line: why this run ended."""
        if self.returncode == EXIT_OK:
            stopped = self.of("stopped")
            return f"stopped ({stopped[-1].get('reason')})" if stopped else "finished"
        error = self.last_error
        if self.fenced:
            detail = error.get("message") if error and error.get("kind") == "fenced" else "no EOS-ERROR line"
            return f"fenced (exit {self.returncode}): {detail}"
        if self.data_lost and not error:
            return f"data lost (exit {self.returncode}): no EOS-ERROR line"
        if error:
            return f"exit {self.returncode}: {error.get('kind')}: {error.get('message')}"
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"killed by {name} (no EOS-ERROR line)"
        tail = self.log_tail.strip().splitlines()[-1:] if self.log_tail else []
        return f"exit {self.returncode} without an EOS-ERROR line" + (f"; last output: {tail[0]}" if tail else "")
