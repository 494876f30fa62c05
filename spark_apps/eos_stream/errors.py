"""Poison means the data, never the weather: which errors may quarantine a record.

The database judges; this module only reads its verdict, the SQLSTATE
(PostgreSQL's error codes, Appendix A). Each class, and why:

=========================  ==========  ==================================================
SQLSTATE                   class       why
=========================  ==========  ==================================================
22xxx data exception       data        the record's value is outside what its column
                                       takes (a timestamp offset past 15:59, an integer
                                       past its type, text too long for ``varchar(n)``):
                                       the same record fails again, the same way
23xxx integrity violation  data        the record breaks a rule of the target (unique,
                                       CHECK, NOT NULL, exclusion): under the schema as it
                                       stands, it never applies. A rule added by a
                                       migration while the stream runs judges every later
                                       record alike; its dead letters keep the raw bytes
                                       and can be replayed once the rule is changed
23503 foreign key          blocked     the parent row may arrive a moment later (another
                                       pipeline, another transaction): the batch is
                                       retried whole with backoff, never quarantined, and
                                       fails loudly when the wait is over
08, 40, 53, 58 classes     transient   connection, serialization failure and deadlock,
55P03, 57014, 57P01-03                 resources, system errors, lock and statement
                                       timeouts, shutdowns: the weather, retried whole
53400 config limit         other       a setting to change, not weather to wait out; so is
                                       PREPARE's "maximum number of prepared transactions
                                       reached" (53200), which ``in_doubt.prepare_failure``
                                       turns into an error naming ``max_prepared_transactions``
anything else              other       a missing table, a permission, a bug: the run
                                       fails at once and says why
=========================  ==========  ==================================================

Plus the app's own ``RecordError`` (the record is not JSON of the spec's shape):
data. A psycopg2 ``OperationalError``/``InterfaceError`` without a SQLSTATE (the
connection broke before the server answered): transient.

An error raised in a Spark executor reaches the driver as a job failure whose
text holds the executor's traceback; a database error raised there carries its
SQLSTATE in that text as ``[EOS-SQLSTATE xxxxx]`` (``tagged``), so it is
classified exactly as if the driver had raised it.
"""

from __future__ import annotations

import re
from typing import Literal

ErrorClass = Literal["data", "blocked", "transient", "other"]

DATA_CLASSES = ("22", "23")
BLOCKED_CODES = frozenset({"23503"})
TRANSIENT_CLASSES = ("08", "40", "53", "58")
TRANSIENT_CODES = frozenset({"55P03", "57014", "57P01", "57P02", "57P03"})
NOT_TRANSIENT_CODES = frozenset({"53400"})  # configuration_limit_exceeded: max_prepared_transactions

_TAG = re.compile(r"\[EOS-SQLSTATE ([0-9A-Z]{5})\]")


def classify_sqlstate(sqlstate: str | None) -> ErrorClass:
    """The class of a PostgreSQL error code (None: no code, counted as other)."""
    if not sqlstate:
        return "other"
    if sqlstate in BLOCKED_CODES:
        return "blocked"
    if sqlstate[:2] in DATA_CLASSES:
        return "data"
    if sqlstate in NOT_TRANSIENT_CODES:
        return "other"
    if sqlstate[:2] in TRANSIENT_CLASSES or sqlstate in TRANSIENT_CODES:
        return "transient"
    return "other"


def one_line(error: BaseException | str, limit: int = 500) -> str:
    """An error's text on one line (PostgreSQL's messages span several: DETAIL, CONTEXT),
    cut at ``limit`` characters, for an event field or a log line."""
    return " ".join(str(error).split())[:limit]


def tagged(exc: BaseException) -> str:
    """The text an executor raises for a database error: its SQLSTATE tag, class and message."""
    code = getattr(exc, "pgcode", None)
    message = (getattr(exc, "pgerror", None) or str(exc)).strip()
    return (f"[EOS-SQLSTATE {code}] " if code else "") + f"{type(exc).__name__}: {message}"


def sqlstate_of(exc: BaseException) -> str | None:
    """The SQLSTATE a psycopg2 error carries, or the one an executor tagged into
    a Spark job failure's text; None when there is neither."""
    code = getattr(exc, "pgcode", None)
    if code:
        return str(code)
    found = _TAG.findall(str(exc))
    return found[-1] if found else None


def classify(exc: BaseException) -> ErrorClass:
    """The class of an exception raised while applying a batch."""
    from spark_apps.eos_stream.records.parsing import RecordError

    if isinstance(exc, RecordError):
        return "data"
    code = sqlstate_of(exc)
    if code:
        return classify_sqlstate(code)
    import psycopg2

    cause: BaseException | None = exc
    while cause is not None:  # also through a wrapper such as "cannot connect to PostgreSQL"
        # Without a SQLSTATE: the connection broke before the server could say why. (With one, a
        # source's error COPY reported as QueryCanceled, it was the source's fault: staging.copy_from_chunks.)
        if isinstance(cause, (psycopg2.OperationalError, psycopg2.InterfaceError)) and not sqlstate_of(cause):
            return "transient"
        cause = cause.__cause__
    return "other"


def dead_letter_class(sqlstate: str | None, error: str) -> str:
    """How the audit groups a dead letter: ``parse`` (rejected by the app's own
    checks: no SQLSTATE), ``data_exception`` (22), ``integrity`` (23), or
    ``not_data:<SQLSTATE>`` for anything a record must never be quarantined for."""
    if not sqlstate:
        return "parse"
    if classify_sqlstate(sqlstate) != "data":
        return f"not_data:{sqlstate}"
    return "data_exception" if sqlstate.startswith("22") else "integrity"
