"""The exit codes of a run (the stream's or the Spark-less replay's) and its errors as one line."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

from spark_apps.eos_stream.errors import sqlstate_of
from spark_apps.eos_stream.events import emit
from spark_apps.eos_stream.kafka import security as kafka_security
from spark_apps.eos_stream.records.spec import SpecError
from spark_apps.eos_stream.run import config_rules, preflight
from spark_apps.eos_stream.run.config import ConfigError, PipelineConfig, parse_args
from spark_apps.eos_stream.run.pyspark_pairing import PysparkPairingError
from spark_apps.eos_stream.sink.postgres import TargetUnavailable
from spark_apps.eos_stream.state import fencing
from spark_apps.eos_stream.state.control import AlreadyRunning

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


# "ValueError: ..." or "psycopg2.errors.StringDataRightTruncation: ..." as Python prints them. The
# class name must hold a lowercase letter: PostgreSQL's message fields (CONTEXT:, DETAIL:, HINT:)
# follow the error in the same text and are not its cause.
_PYTHON_ERROR_LINE = re.compile(r"^\s*((?:[a-z_]\w*\.)*[A-Z]\w*[a-z]\w*): (.+)$")
# Of those, the ones that name an exception: a module-qualified class (psycopg2.errors.X, py4j...)
# or a name ending the way exceptions do. Spark's query report ("Identifier: eos-x [id = ...]",
# "Current Committed Offsets: ...") has the same shape and follows the traceback.
_EXCEPTION_NAME = re.compile(r"(\.|Error$|Exception$|Stuck$|Blocked$|Fenced$|Unavailable$)")


def root_cause(exc: BaseException) -> str:
    """The innermost Python error inside Spark's wrapping (a failed foreachBatch
    arrives as STREAM_FAILED with the real traceback in its text), with the
    SQLSTATE when the database raised it; an error raised outside Spark (the
    last batch's apply, which ends after the query) reads the same way:
    its class, then its first line."""
    text = str(exc)
    lines = [m for m in map(_PYTHON_ERROR_LINE.match, text.splitlines()) if m]
    named = [m for m in lines if _EXCEPTION_NAME.search(m.group(1))] or lines
    if not named:
        return f"{type(exc).__name__}: {text.strip().splitlines()[0]}" if text.strip() else type(exc).__name__
    cause = named[-1].group(1).rsplit(".", 1)[-1] + ": " + named[-1].group(2).strip()
    code = sqlstate_of(exc)
    return f"{cause} (SQLSTATE {code})" if code and code not in cause else cause


def main(argv: list[str] | None, run: Callable[[PipelineConfig], int],
         before: Callable[[], None] | None = None) -> int:
    """Runs the pipeline with ``run`` (after ``before``, a check of the environment) and turns
    its errors into the exit codes of ``app``'s docstring."""
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
        message = root_cause(exc)
        emit("error", kind="failed", message=message[:2000])
        print(f"eos-stream: failed: {message}", file=sys.stderr)
        return EXIT_FAILED
