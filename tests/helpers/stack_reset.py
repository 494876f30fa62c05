"""Between ``make test``'s two phases, on a stack that run started itself: the connectors and
topics the first phase's tests left behind are deleted, so the ``stack_faults`` tests that
follow kill and restart a broker that holds only their own partitions.

A SIGKILLed broker recovers every partition's log before it listens again (about 100 s for a
long-lived local broker's thousand partitions on 2 cores; 121 topics are left by a CI run's
first phase), and a leftover connector keeps polling its source and writing its topics while
they run. Kafka's internal topics (``__*``) and the Connect worker's own (``eos-connect-*``) stay.

    .venv/bin/python -m tests.helpers.stack_reset
"""

from __future__ import annotations

import os
import sys

import requests
from confluent_kafka.admin import AdminClient

from bench.harness import kafka_connect_connection, wait_until
from demo.env_files import STATE_DIR, read_env_file
from tests.helpers.airflow_tests_env import own_airflow_env
from tests.helpers.kafka import delete_topics

KEPT_PREFIXES = ("__", "eos-connect-")
CONNECT_CONN = "eos_stack_reset_connect"


def delete_connectors(stack: dict[str, str]) -> list[str]:
    """Deletes every connector of the stack's Connect worker; none when the worker is not running.
    Airflow runs in the tests' own deployment (``own_airflow_env``), never in a default home."""
    os.environ.update(own_airflow_env())
    os.environ[f"AIRFLOW_CONN_{CONNECT_CONN.upper()}"] = kafka_connect_connection(stack)
    from airflow_provider_eos.hooks.kafka_connect import KafkaConnectError, KafkaConnectHook

    hook = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)
    try:
        names = hook.list_connectors()
    except KafkaConnectError as err:
        if isinstance(err.__cause__, requests.ConnectionError):
            return []
        raise
    for name in names:
        hook.delete_connector(name)
    return names


def delete_leftover_topics(bootstrap: str) -> int:
    """Deletes every topic but the kept ones and waits until the broker lists none of them."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    doomed = [t for t in admin.list_topics(timeout=30).topics if not t.startswith(KEPT_PREFIXES)]
    if doomed:
        delete_topics(bootstrap, *doomed)
        wait_until("the deleted topics gone from the broker's list",
                   lambda: not set(doomed) & set(admin.list_topics(timeout=30).topics))
    return len(doomed)


def main() -> int:
    stack = read_env_file(STATE_DIR / "stack.env")
    connectors = delete_connectors(stack)
    topics = delete_leftover_topics(stack["EOS_KAFKA_BOOTSTRAP"])
    print(f"stack reset: {len(connectors)} connectors and {topics} topics deleted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
