"""Poison means the data, never the weather: which errors may quarantine a record.

Classification by SQLSTATE (PostgreSQL's error codes, Appendix A):

* **data**: class 22 (data exception: a value too long, out of range, invalid
  text) and class 23 (integrity constraint violation), plus the parse and
  validation errors the app raises itself (``RecordError``). Only these may
  quarantine a record, because only these fail again, the same way, for the
  same record.
* **transient**: class 08 (connection), 40 (serialization failure, deadlock),
  53 (insufficient resources), 55P03 (lock not available), 57014 (query
  canceled: statement and lock timeouts), 57P01-57P03 (admin shutdown, crash
  shutdown, cannot connect now) and 58 (system error); and a psycopg2
  ``OperationalError``/``InterfaceError`` that carries no SQLSTATE (the
  connection broke before the server answered). These never quarantine
  anything: the batch is rolled back and retried later, whole.
* **other**: everything else (a missing table, a permission, a bug). Not
  poison either: the run fails and says why.
"""

from __future__ import annotations

from typing import Literal

ErrorClass = Literal["data", "transient", "other"]

DATA_CLASSES = ("22", "23")
TRANSIENT_CLASSES = ("08", "40", "53", "58")
TRANSIENT_CODES = frozenset({"55P03", "57014", "57P01", "57P02", "57P03"})


def classify_sqlstate(sqlstate: str | None) -> ErrorClass:
    """The class of a PostgreSQL error code (None: no code, counted as other)."""
    if not sqlstate:
        return "other"
    if sqlstate[:2] in DATA_CLASSES:
        return "data"
    if sqlstate[:2] in TRANSIENT_CLASSES or sqlstate in TRANSIENT_CODES:
        return "transient"
    return "other"


def sqlstate_of(exc: BaseException) -> str | None:
    """The SQLSTATE a psycopg2 error carries, if any."""
    code = getattr(exc, "pgcode", None)
    return str(code) if code else None


def classify(exc: BaseException) -> ErrorClass:
    """The class of an exception raised while applying a batch."""
    from spark_apps.eos_stream.records import RecordError

    if isinstance(exc, RecordError):
        return "data"
    code = sqlstate_of(exc)
    if code:
        return classify_sqlstate(code)
    import psycopg2

    if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)):
        return "transient"  # the connection broke before the server could say why
    return "other"


def dead_letter_class(sqlstate: str | None, error: str) -> str:
    """How the audit groups a dead letter: ``parse`` (rejected by the app's own
    checks: no SQLSTATE), ``data_exception`` (22), ``integrity`` (23), or
    ``not_data:<SQLSTATE>`` for anything a record must never be quarantined for."""
    if not sqlstate:
        return "parse"
    if sqlstate.startswith("22"):
        return "data_exception"
    if sqlstate.startswith("23"):
        return "integrity"
    return f"not_data:{sqlstate}"
