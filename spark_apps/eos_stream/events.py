"""The app's event lines on stdout (``EOS-<EVENT> {json}``), which supervisors parse. Apart from
``progress`` so that the Spark-less replay writes them without importing pyspark."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit(event: str, **fields: Any) -> None:
    """One machine-readable line; supervisors parse lines starting with ``EOS-``.

    Written with one write: print() writes the text and its newline apart, and
    the JVM's log lines, on the same pipe, landed between the two (seen in CI:
    an ``EOS-STOPPED`` line with a Spark WARN glued to it)."""
    sys.stdout.write(f"EOS-{event.upper()} {json.dumps(fields, default=str, sort_keys=True)}\n")
    sys.stdout.flush()
