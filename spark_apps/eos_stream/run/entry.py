"""The exit codes of a run, whichever engine runs it (``engines/``), and its errors as one line.

Exit codes: 0 finished or stopped on request (also before the first batch); 1 failed
(retryable: a supervisor restarts it); 2 configuration error (retrying will not help); 3 fenced
(``fencing.EXIT_FENCED``: this driver no longer owns the target; start again from the
database's offsets, unless a stop or a recovery holds the pipeline); 4 data lost
(``lost_data.EXIT_DATA_LOST``: a stored offset Kafka no longer holds, or Spark's source lost
records mid-stream; no restart can help, ``eos offsets reset`` is the way out). The continuous
engine ends on a SIGTERM with 143 (``engines/continuous.py``, C9). Lines starting with ``EOS-``
are machine-readable progress for the supervisor (``events.emit``).
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable
from typing import Any

from spark_apps.eos_stream.errors import sqlstate_of
from spark_apps.eos_stream.events import emit
from spark_apps.eos_stream.kafka import lost_data
from spark_apps.eos_stream.kafka import security as kafka_security
from spark_apps.eos_stream.records.spec import SpecError
from spark_apps.eos_stream.run import config_rules, preflight
from spark_apps.eos_stream.run.config import ConfigError, PipelineConfig, parse_args
from spark_apps.eos_stream.run.pyspark_pairing import PysparkPairingError
from spark_apps.eos_stream.sink.postgres import TargetUnavailable
from spark_apps.eos_stream.state import fencing
from spark_apps.eos_stream.state.control import AlreadyRunning

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
# 3 is fencing.EXIT_FENCED; 4 is lost_data.EXIT_DATA_LOST (a stored offset Kafka no longer holds).
EXIT_DATA_LOST = lost_data.EXIT_DATA_LOST


# "ValueError: ..." or "psycopg2.errors.StringDataRightTruncation: ..." as Python prints them. The
# class name must hold a lowercase letter: PostgreSQL's message fields (CONTEXT:, DETAIL:, HINT:)
# follow the error in the same text and are not its cause.
_PYTHON_ERROR_LINE = re.compile(r"^\s*((?:[a-z_]\w*\.)*[A-Z]\w*[a-z]\w*): (.+)$")
# Of those, the ones that name an exception: a module-qualified class (psycopg2.errors.X, py4j...)
# or a name ending the way exceptions do. Spark's query report ("Identifier: eos-x [id = ...]",
# "Current Committed Offsets: ...") has the same shape and follows the traceback.
_EXCEPTION_NAME = re.compile(r"(\.|Error$|Exception$|Stuck$|Blocked$|Fenced$|Unavailable$)")


def _java_causes(origin: Any, limit: int = 20) -> list[tuple[str, str]]:
    """(class name, message) of a Java throwable and each of its causes, outermost first."""
    chain: list[tuple[str, str]] = []
    with contextlib.suppress(Exception):  # a py4j gateway already gone: the Python side's text must do
        while origin is not None and len(chain) < limit:
            chain.append((str(origin.getClass().getName()), str(origin.getMessage() or "")))
            cause = origin.getCause()
            origin = None if cause is None or cause.equals(origin) else cause
    return chain


def cause_chain(exc: BaseException) -> list[tuple[str, str]]:
    """(class name, message) of ``exc``, its Python causes and, for an error pyspark raised from
    the JVM (a ``StreamingQueryException``: its ``_origin``, or py4j's ``java_exception``), every
    Java cause beneath it, outermost first. Spark's query failure names only the query
    (``Identifier: eos-x [id = ..., runId = ...]``) in its text; the cause is down this chain."""
    chain: list[tuple[str, str]] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append((type(current).__name__, str(current)))
        origin = getattr(current, "_origin", None) or getattr(current, "java_exception", None)
        if origin is not None:
            chain.extend(_java_causes(origin))
        current = current.__cause__ or current.__context__
    return chain


def _python_error(text: str) -> str | None:
    """The last error line Python printed in ``text`` ("ValueError: ..."), preferring one whose
    name reads as an exception's, as ``Name: message``."""
    lines = [m for m in map(_PYTHON_ERROR_LINE.match, text.splitlines()) if m]
    named = [m for m in lines if _EXCEPTION_NAME.search(m.group(1))]
    if not named:
        return None
    return named[-1].group(1).rsplit(".", 1)[-1] + ": " + named[-1].group(2).strip()


def _one_line(text: str, limit: int = 1500) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())[:limit]


def root_cause(exc: BaseException) -> str:
    """The innermost cause of a failure, with the SQLSTATE when the database raised it.

    A failed foreachBatch arrives as STREAM_FAILED with the Python traceback in its text: its
    innermost Python error. A failure inside the JVM (Spark's Kafka source, a lost executor)
    names only the query in its text: then the innermost Java cause of ``cause_chain``, its
    class and message. An error raised outside Spark (the last batch's apply, which ends after
    the query) reads the same way: its class, then its first line."""
    text = str(exc)
    cause = _python_error(text)
    if cause is None:
        java = [(name, message) for name, message in cause_chain(exc)[1:] if "." in name and message.strip()]
        if java:
            name, message = java[-1]
            cause = _python_error(message) or f"{name.rsplit('.', 1)[-1]}: {_one_line(message)}"
    if cause is None:
        lines = [m for m in map(_PYTHON_ERROR_LINE.match, text.splitlines()) if m]
        if not lines:
            return f"{type(exc).__name__}: {text.strip().splitlines()[0]}" if text.strip() else type(exc).__name__
        cause = lines[-1].group(1).rsplit(".", 1)[-1] + ": " + lines[-1].group(2).strip()
    code = sqlstate_of(exc)
    return f"{cause} (SQLSTATE {code})" if code and code not in cause else cause


def _data_lost(exc: BaseException, config: PipelineConfig | None) -> str | None:
    """The message of a run that failed because Kafka lost records it had to read, or None:
    the claim's check (``lost_data.DataLost``), or Spark's source failing on it mid-stream."""
    if isinstance(exc, lost_data.DataLost):
        return str(exc)
    texts = [f"{name}: {message}" for name, message in cause_chain(exc)]
    if not lost_data.is_spark_data_loss(texts):
        return None
    pipeline = config.pipeline if config is not None else "<pipeline>"
    return (f"pipeline {pipeline!r}: Kafka no longer holds records the stream had to read: "
            f"{root_cause(exc).rstrip('.')}. {lost_data.way_out(pipeline)}")


def main(argv: list[str] | None, run: Callable[[PipelineConfig], int],
         before: Callable[[], None] | None = None) -> int:
    """Runs the pipeline with ``run`` (after ``before``, a check of the environment) and turns
    its errors into the exit codes above."""
    config: PipelineConfig | None = None
    try:
        if before is not None:
            before()
        # Every refusal the config alone earns, before Spark or a connection (config_rules).
        config = config_rules.refuse(parse_args(argv))
        return run(config)
    except (ConfigError, SpecError, PysparkPairingError, kafka_security.KafkaSecurityError) as exc:
        emit("error", kind="config", message=str(exc))
        print(f"eos-stream: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except fencing.Fenced as exc:
        emit("error", kind="fenced", message=str(exc))
        print(f"eos-stream: fenced: {exc}", file=sys.stderr)
        return fencing.EXIT_FENCED
    except (TargetUnavailable, preflight.KafkaUnavailable, AlreadyRunning) as exc:
        emit("error", kind="unavailable", message=str(exc))
        print(f"eos-stream: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:
        lost = _data_lost(exc, config)
        if lost is not None:
            emit("error", kind=lost_data.DATA_LOST_KIND, message=lost[:4000])
            print(f"eos-stream: data lost: {lost}", file=sys.stderr)
            return lost_data.EXIT_DATA_LOST
        message = root_cause(exc)
        emit("error", kind="failed", message=message[:2000])
        print(f"eos-stream: failed: {message}", file=sys.stderr)
        return EXIT_FAILED
