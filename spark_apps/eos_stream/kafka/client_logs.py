"""librdkafka's log lines go to Python logging, never straight to stderr.

Left alone, every confluent-kafka client prints its warnings itself (``%4|1732...|FAIL|rdkafka#...``)
on the process's stderr, between whatever else the process prints. Given a ``logger``, the client
hands each line to it instead, from its ``poll()``/``consume()``/``flush()`` calls: Airflow's task
log, the app's log or a console's logging config then decides where it goes and at which level.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

KAFKA_LOGGER = logging.getLogger("eos.kafka")


def with_python_logging(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A confluent-kafka client's settings with its log lines sent to the ``eos.kafka`` logger."""
    return {**settings, "logger": KAFKA_LOGGER}
