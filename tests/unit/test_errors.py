"""Poison means the data, never the weather: the SQLSTATE classification table.

Pure logic, so real psycopg2 exception classes stand in for the server (their
``pgcode`` is what the server would have sent)."""

from __future__ import annotations

import psycopg2
import psycopg2.errors
import pytest

from spark_apps.eos_stream.errors import classify, classify_sqlstate, dead_letter_class
from spark_apps.eos_stream.records.parsing import RecordError


@pytest.mark.parametrize(
    ("sqlstate", "expected"),
    [
        # data: only these may quarantine a record
        ("22001", "data"),  # string_data_right_truncation: the ledger's poison record
        ("22003", "data"),  # numeric_value_out_of_range
        ("22P02", "data"),  # invalid_text_representation
        ("23505", "data"),  # unique_violation
        ("23502", "data"),  # not_null_violation
        ("23514", "data"),  # check_violation
        ("22009", "data"),  # invalid_time_zone_displacement_value: a +16:00 offset
        ("22021", "data"),  # character_not_in_repertoire
        # blocked: the parent row may arrive later; retried with backoff, never quarantined
        ("23503", "blocked"),  # foreign_key_violation
        # transient: retried whole, never quarantined, never counted
        ("08000", "transient"),  # connection_exception
        ("08006", "transient"),  # connection_failure
        ("40001", "transient"),  # serialization_failure
        ("40P01", "transient"),  # deadlock_detected
        ("53100", "transient"),  # disk_full
        ("53200", "transient"),  # out_of_memory
        ("53300", "transient"),  # too_many_connections
        ("55P03", "transient"),  # lock_not_available: lock_timeout
        ("57014", "transient"),  # query_canceled: statement_timeout
        ("57P01", "transient"),  # admin_shutdown
        ("57P02", "transient"),  # crash_shutdown
        ("57P03", "transient"),  # cannot_connect_now
        ("58030", "transient"),  # io_error
        ("53400", "other"),  # configuration_limit_exceeded: max_prepared_transactions used up, not weather
        # other: the run fails and says why; not poison either
        ("42P01", "other"),  # undefined_table
        ("42501", "other"),  # insufficient_privilege
        ("42703", "other"),  # undefined_column
        ("55000", "other"),  # object_not_in_prerequisite_state: class 55 is not transient as a whole
        ("55006", "other"),  # object_in_use
        ("57000", "other"),  # operator_intervention: only the listed 57 codes are transient
        ("57P04", "other"),  # database_dropped
        ("XX000", "other"),  # internal_error
        ("", "other"),
        (None, "other"),
    ],
)
def test_sqlstate_classes(sqlstate: str | None, expected: str) -> None:
    assert classify_sqlstate(sqlstate) == expected


def _server_error(cls: type[psycopg2.Error], sqlstate: str) -> psycopg2.Error:
    # pgcode is read-only on psycopg2 errors; a subclass carries it as the server would.
    return type(cls.__name__, (cls,), {"pgcode": sqlstate})("message from the server")


def _wrapped(cause: BaseException) -> BaseException:
    try:
        raise RuntimeError("cannot connect to PostgreSQL") from cause
    except RuntimeError as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (RecordError("malformed JSON"), "data"),
        (_server_error(psycopg2.errors.StringDataRightTruncation, "22001"), "data"),
        (_server_error(psycopg2.errors.UniqueViolation, "23505"), "data"),
        (_server_error(psycopg2.errors.LockNotAvailable, "55P03"), "transient"),
        (_server_error(psycopg2.errors.QueryCanceled, "57014"), "transient"),
        (_server_error(psycopg2.errors.DeadlockDetected, "40P01"), "transient"),
        (_server_error(psycopg2.errors.AdminShutdown, "57P01"), "transient"),
        (_server_error(psycopg2.errors.UndefinedTable, "42P01"), "other"),
        # No SQLSTATE: the connection broke before the server could answer.
        (psycopg2.OperationalError("server closed the connection unexpectedly"), "transient"),
        (psycopg2.InterfaceError("connection already closed"), "transient"),
        # Not from the database at all: a bug, or Spark failing around the sink.
        (RuntimeError("py4j: STREAM_FAILED"), "other"),
        # An executor's database error, as text inside Spark's job failure: its tag carries the SQLSTATE.
        (RuntimeError("STREAM_FAILED ... StageCopyError: [EOS-SQLSTATE 22021] CharacterNotInRepertoire: x"), "data"),
        (RuntimeError("Job aborted ... StageCopyError: [EOS-SQLSTATE 57P01] AdminShutdown: terminating"),
         "transient"),
        # A wrapper around a lost connection ("cannot connect to PostgreSQL ...") is still the weather.
        (_wrapped(psycopg2.OperationalError("connection refused")), "transient"),
        # A source's own error, chained from the QueryCanceled psycopg2 makes of a failed COPY read: not weather.
        (_wrapped(_server_error(psycopg2.errors.QueryCanceled, "57014")), "other"),
        (psycopg2.ProgrammingError("no results to fetch"), "other"),
    ],
)
def test_exception_classes(exc: BaseException, expected: str) -> None:
    assert classify(exc) == expected


@pytest.mark.parametrize(
    ("sqlstate", "expected"),
    [(None, "parse"), ("22001", "data_exception"), ("23505", "integrity"), ("55P03", "not_data:55P03"),
     ("57014", "not_data:57014"), ("23503", "not_data:23503")],
)
def test_dead_letter_classes(sqlstate: str | None, expected: str) -> None:
    assert dead_letter_class(sqlstate, "an error") == expected


def test_a_nul_in_a_text_field_is_the_apps_own_data_error() -> None:
    """PostgreSQL text cannot hold NUL. Found by the app, the record is
    dead-lettered on the first attempt; left to COPY, it would fail staging on
    an executor, where no SQLSTATE reaches the poison guard."""
    from spark_apps.eos_stream.records.parsing import parse_record
    from spark_apps.ledger.spec import LEDGER

    value = (b'{"event_id": "e\\u0000", "account_id": "acct-00001", "amount_cents": 1,'
             b' "ts": "2026-01-01T00:00:00+00:00", "seq": 1}')
    with pytest.raises(RecordError, match="NUL character") as caught:
        parse_record(LEDGER, value)
    assert classify(caught.value) == "data"


def test_the_tag_round_trips_a_database_errors_sqlstate() -> None:
    from spark_apps.eos_stream.errors import sqlstate_of, tagged

    text = tagged(_server_error(psycopg2.errors.InvalidTimeZoneDisplacementValue, "22009"))
    assert text.startswith("[EOS-SQLSTATE 22009] ")
    assert sqlstate_of(RuntimeError(f"Py4JJavaError ... {text}\n\tat org.apache.spark")) == "22009"
