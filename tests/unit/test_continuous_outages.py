"""The continuous engine's pure parts for weather: the reconnect bound and backoff
(``state/reconnect``), a cycle's byte bound, the Kafka errors it waits out and the partitions a
refresh finds and holds back (``engines/continuous_read``), the sessions' timeouts and the waits a
SIGTERM or a stop ends."""

from __future__ import annotations

from typing import Any

import psycopg2
import pytest
from confluent_kafka import KafkaError

from spark_apps.eos_stream.engines import continuous, continuous_waits
from spark_apps.eos_stream.engines.continuous_read import caught_up, kafka_error_kind, new_partitions, poll_count
from spark_apps.eos_stream.kafka.ranges import EARLIEST
from spark_apps.eos_stream.run.config import PipelineConfig, PostgresTarget
from spark_apps.eos_stream.state import fencing
from spark_apps.eos_stream.state.reconnect import Outage, OutageTooLong, backoff_seconds, call_through


def test_backoff_doubles_from_half_a_second_up_to_its_cap() -> None:
    assert [backoff_seconds(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_raises_once_it_lasted_past_its_bound_naming_step_and_place() -> None:
    clock = Clock()
    outage = Outage("cycle commit", "PostgreSQL u@db:5432/eos", 10, clock=clock)
    cause = psycopg2.OperationalError("server closed the connection unexpectedly\n\tThis probably means")
    for clock.now in (0, 4, 10):  # at the bound, not past it
        outage.failed(cause)
    clock.now = 10.5
    with pytest.raises(OutageTooLong) as raised:
        outage.failed(cause)
    assert str(raised.value) == ("step 'cycle commit' could not reach PostgreSQL u@db:5432/eos for 10 s, past its "
                                 "bound (transient_retry_seconds): OperationalError: server closed the connection "
                                 "unexpectedly This probably means")
    assert raised.value.__cause__ is cause


def test_a_success_ends_the_outage() -> None:
    clock = Clock()
    outage = Outage("poll", "PostgreSQL", 10, clock=clock)
    outage.failed(RuntimeError("lost"))
    clock.now = 8
    outage.ok()
    clock.now = 15
    assert outage.failed(RuntimeError("lost")) == 0.5  # a new outage, its first wait


def test_call_through_retries_weather_with_backoff_and_raises_anything_else_at_once() -> None:
    calls, waits = [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise psycopg2.OperationalError("lost")
        return "claimed"

    transient = lambda exc: isinstance(exc, psycopg2.OperationalError)  # noqa: E731
    assert call_through("claim", "PostgreSQL", 60, flaky, transient=transient, sleep=waits.append) == "claimed"
    assert waits == [0.5, 1.0, 2.0]

    def broken() -> str:
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        call_through("claim", "PostgreSQL", 60, broken, transient=transient, sleep=waits.append)


def test_call_through_gives_up_after_its_bound() -> None:
    def down() -> None:
        raise psycopg2.OperationalError("the database system is starting up")

    with pytest.raises(OutageTooLong, match="step 'claim' could not reach"):
        call_through("claim", "PostgreSQL", 0, down, transient=lambda exc: True, sleep=lambda seconds: None)


def test_a_poll_asks_for_no_more_records_than_fit_in_the_bytes_left() -> None:
    assert poll_count(20_000, 32 << 20, 0) == 1  # no record seen yet: one
    assert poll_count(20_000, 32 << 20, 100) == 20_000  # the record bound
    assert poll_count(500_000, 1 << 40, 1) == 100_000  # librdkafka's own limit
    assert poll_count(20_000, 1000, 300) == 3  # 3 records of the largest size fit
    assert poll_count(20_000, 10, 300) == 1  # never less than one: the loop ends on its bound


@pytest.mark.parametrize(("error", "kind"), [
    (KafkaError(KafkaError._PARTITION_EOF), "skip"),
    (KafkaError(KafkaError._TRANSPORT), "transient"),
    (KafkaError(KafkaError._ALL_BROKERS_DOWN), "transient"),
    (KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION), "transient"),
    (KafkaError(KafkaError.UNKNOWN, retriable=True), "transient"),  # librdkafka says retriable
    (KafkaError(KafkaError._TRANSPORT, fatal=True), "fatal"),
    (KafkaError(KafkaError.OFFSET_OUT_OF_RANGE), "fatal"),
    (KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), "fatal"),
])
def test_which_kafka_errors_are_waited_out(error: Any, kind: str) -> None:
    assert kafka_error_kind(error) == kind


def _config(**postgres: Any) -> PipelineConfig:
    return PipelineConfig(pipeline="p", topics=["t"], spec="s:S", postgres=PostgresTarget(**postgres))


def test_every_session_gets_the_timeouts_and_its_own_options_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGOPTIONS", raising=False)
    config = continuous.with_session_timeouts(_config(options={"options": "-c lock_timeout=10s"}, password="pw"))
    options = config.postgres.dsn_kwargs()["options"]
    assert options.index("-c lock_timeout=3s") < options.index("-c lock_timeout=10s")  # the later wins
    assert "-c statement_timeout=30s" in options and "tcp_keepalives_idle=30" in options
    assert config.postgres.password == "pw"
    monkeypatch.setenv("PGOPTIONS", "-c work_mem=64MB")  # libpq's, kept once options are set
    assert continuous.with_session_timeouts(_config()).postgres.options["options"].endswith("-c work_mem=64MB")


class Stop:
    def __init__(self, fenced: str | None = None, requested: str | None = None) -> None:
        self._fenced, self._requested, self.polls = fenced, requested, 0

    def fenced(self) -> str | None:
        self.polls += 1
        return self._fenced

    def requested(self) -> str | None:
        return self._requested


def test_a_retrys_wait_ends_on_sigterm_a_stop_or_a_fence() -> None:
    waits = continuous_waits.Waits(poll_seconds=0.02)
    waits.pause(0.01)  # nothing asked: it waits its time
    waits.stop = Stop()  # type: ignore[assignment]
    waits.pause(0.05)
    assert waits.stop.polls >= 2  # type: ignore[attr-defined]
    waits.stop = Stop(requested="stop requested at now")  # type: ignore[assignment]
    with pytest.raises(continuous_waits.Interrupted, match="stop requested"):
        waits.pause(60)
    waits.stop = Stop(fenced="its epoch is 4")  # type: ignore[assignment]
    with pytest.raises(fencing.Fenced):
        waits.pause(60)
    waits.stop = None
    waits.on_sigterm(15, None)
    with pytest.raises(continuous_waits.Interrupted) as raised:
        waits.pause(60)
    assert raised.value.reason == continuous_waits.TERMINATED_MID_CYCLE


A0, A1, A2, A3, B0 = ("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0)


def test_a_refresh_finds_the_partitions_neither_read_nor_held() -> None:
    assert new_partitions({A0, A1, A2}, {A0, A1, A2, A3, B0}) == [A3, B0]
    assert new_partitions({A0, A1}, {A0}) == []  # a partition gone from the metadata is not new


def test_a_new_partition_waits_until_its_topics_others_are_committed_up_to_their_end() -> None:
    ends = {A0: 120, A1: 0}
    assert not caught_up({A0: 119, A1: EARLIEST}, ends)
    assert caught_up({A0: 120, A1: EARLIEST}, ends)  # never applied, and nothing to apply
    assert caught_up({A0: 150, A1: 3}, ends)
    assert not caught_up({A0: EARLIEST, A1: 3}, {A0: 1, A1: 0})
