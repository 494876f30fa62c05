"""Between ``make test``'s two phases, on a stack that run started itself: the connectors and
topics the first phase's tests left behind are deleted, so the ``stack_faults`` tests that
follow kill and restart a broker of a few partitions instead of about a thousand.

A SIGKILLed broker recovers every partition's log before it listens again (about 100 s for
the first phase's thousand partitions on 2 cores, against seconds for the few left here), and
a leftover connector keeps polling its source and writing its topics while they run.
Kafka's internal topics (``__*``) and the Connect worker's own (``eos-connect-*``) stay.

    .venv/bin/python -m tests.helpers.stack_reset
"""

from __future__ import annotations

import sys
import time

import requests
from confluent_kafka.admin import AdminClient

from demo.env_files import STATE_DIR, read_env_file

KEPT_PREFIXES = ("__", "eos-connect-")


def delete_connectors(connect_url: str) -> list[str]:
    """Deletes every connector of the Connect worker at ``connect_url``; none when it is down."""
    try:
        names = requests.get(f"{connect_url}/connectors", timeout=10).json()
    except requests.ConnectionError:
        return []
    for name in names:
        requests.delete(f"{connect_url}/connectors/{name}", timeout=30).raise_for_status()
    return list(names)


def delete_topics(bootstrap: str, timeout: float = 120) -> int:
    """Deletes every topic but the kept ones and waits until the broker lists none of them."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    doomed = [t for t in admin.list_topics(timeout=30).topics if not t.startswith(KEPT_PREFIXES)]
    for start in range(0, len(doomed), 200):
        for future in admin.delete_topics(doomed[start:start + 200], operation_timeout=60).values():
            future.result(90)
    deadline = time.monotonic() + timeout
    while set(doomed) & set(admin.list_topics(timeout=30).topics):
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics still listed {timeout:.0f} s after their deletion")
        time.sleep(1)
    return len(doomed)


def main() -> int:
    env = read_env_file(STATE_DIR / "stack.env")
    connectors = delete_connectors(env["EOS_CONNECT_URL"])
    topics = delete_topics(env["EOS_KAFKA_BOOTSTRAP"])
    print(f"stack reset: {len(connectors)} connectors and {topics} topics deleted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
