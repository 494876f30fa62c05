"""One worker process of the audit's parallel read of Kafka (started by ``audit_readers``).

Reads from stdin two pickles, the parent's ``sys.path`` (so the spec's module imports here as
it did there) and an ``audit_kafka.ReadTask``; reads and judges its partitions
(``audit_kafka.read_task``) and writes one pickle to stdout, its answer:

* ``("ok", KafkaSide)``,
* ``("timeout", unfinished)``: the deadline passed, ``unfinished`` as ``AuditTimeout.unfinished``,
* ``("error", summary, traceback)``: anything else that went wrong, as text (an exception
  object may not pickle; its text always does).

The task travels on stdin, so the Kafka security options are never on a command line.

    python -c 'from spark_apps.eos_stream.audit.worker import main; main()'
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any


def answer_for(stdin: Any) -> tuple:
    """The answer to the task on ``stdin`` (a binary stream)."""
    from spark_apps.eos_stream.audit.rules import AuditTimeout

    try:
        sys.path[:] = pickle.load(stdin)
        from spark_apps.eos_stream.audit.kafka import read_task

        return "ok", read_task(pickle.load(stdin))
    except AuditTimeout as exc:
        return "timeout", exc.unfinished
    except BaseException as exc:  # every failure is the parent's to raise, as text
        return "error", f"{type(exc).__name__}: {exc}", traceback.format_exc()


def main() -> None:
    # The answer gets stdout's pipe to itself: whatever a library prints goes to stderr instead.
    answer = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    result = answer_for(sys.stdin.buffer)
    with answer:
        pickle.dump(result, answer, protocol=pickle.HIGHEST_PROTOCOL)


if __name__ == "__main__":
    main()
