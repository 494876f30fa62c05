"""librdkafka's lines reach Python logging, never the process's stderr: a real confluent-kafka
client pointed at a port where nothing listens logs its connection failures."""

from __future__ import annotations

import logging
import socket
import time

import pytest
from confluent_kafka import Consumer

from spark_apps.eos_stream.kafka.client_logs import KAFKA_LOGGER, with_python_logging


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fail_to_connect(settings: dict) -> None:
    consumer = Consumer({"bootstrap.servers": f"127.0.0.1:{_closed_port()}", "group.id": "eos-log-test",
                         "reconnect.backoff.ms": 100, **settings})
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        consumer.poll(0.2)  # serves the client's log lines
    consumer.close()


def test_librdkafka_lines_go_to_the_eos_kafka_logger(capfd: pytest.CaptureFixture[str],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=KAFKA_LOGGER.name):
        _fail_to_connect(with_python_logging({}))
    assert any(r.name == "eos.kafka" and "Connection refused" in r.getMessage() for r in caplog.records)
    assert "%3|" not in capfd.readouterr().err


def test_without_it_librdkafka_prints_on_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    """The negative control: what the clients did before."""
    _fail_to_connect({})
    assert "%3|" in capfd.readouterr().err


def test_the_settings_given_are_left_alone() -> None:
    settings = {"bootstrap.servers": "k:9092"}
    assert with_python_logging(settings) == {"bootstrap.servers": "k:9092", "logger": KAFKA_LOGGER}
    assert settings == {"bootstrap.servers": "k:9092"}
