"""How far each partition's last stable offset trails its high watermark, sampled for the report."""

from __future__ import annotations

import threading
import time

from demo.names import TOPIC
from spark_apps.eos_stream.kafka.client_logs import with_python_logging


class LsoSampler(threading.Thread):
    """Samples HW - LSO per partition of every demo topic each second, for the report's plot."""

    def __init__(self, bootstrap: str, topics: list[str]) -> None:
        super().__init__(daemon=True)
        from confluent_kafka.admin import AdminClient

        self.admin = AdminClient(with_python_logging({"bootstrap.servers": bootstrap}))
        self.topics = topics
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self.started = time.monotonic()
        self.stop_event = threading.Event()

    def latest(self, committed: bool, topic: str = TOPIC) -> dict[int, int]:
        """Latest offset per partition: the LSO when ``committed``, else the high watermark."""
        from confluent_kafka import IsolationLevel, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        partitions = self.admin.list_topics(topic, timeout=10).topics[topic].partitions
        request = {TopicPartition(topic, p): OffsetSpec.latest() for p in partitions}
        level = IsolationLevel.READ_COMMITTED if committed else IsolationLevel.READ_UNCOMMITTED
        result = self.admin.list_offsets(request, isolation_level=level)
        return {tp.partition: result[tp].result().offset for tp in request}

    def lag(self, topic: str = TOPIC) -> dict[int, int]:
        hw, lso = self.latest(committed=False, topic=topic), self.latest(committed=True, topic=topic)
        return {partition: hw[partition] - lso.get(partition, hw[partition]) for partition in hw}

    def run(self) -> None:
        while not self.stop_event.wait(1.0):
            for topic in self.topics:
                try:
                    for partition, lag in self.lag(topic).items():
                        self.samples.setdefault(f"{topic}[{partition}]", []).append(
                            (time.monotonic() - self.started, lag))
                except Exception:  # a sample missed while the broker is busy is not worth failing the demo
                    continue
