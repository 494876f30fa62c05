"""A transactional producer that leaves its transaction open and waits to be killed.

    python -m tests.helpers.txn_producer BOOTSTRAP TOPIC PARTITION COUNT TXN_TIMEOUT_MS [TXN_ID]

It runs init_transactions, begin_transaction, produces COUNT records to
TOPIC[PARTITION], flushes, prints one JSON line ``{"ready": true, ...}`` on stdout
and then sleeps until it is SIGKILLed (so the transaction is neither committed nor
aborted by the client; only the coordinator, after TXN_TIMEOUT_MS, or an admin
abort can end it).
"""

from __future__ import annotations

import json
import sys
import time
import uuid

from confluent_kafka import Producer


def main(argv: list[str]) -> int:
    bootstrap, topic, partition, count, txn_timeout_ms = argv[:5]
    txn_id = argv[5] if len(argv) > 5 else f"eos-test-{uuid.uuid4().hex[:10]}"
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": txn_id,
            "transaction.timeout.ms": int(txn_timeout_ms),
            "enable.idempotence": True,
        }
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(int(count)):
        producer.produce(topic, value=f"open-{i}".encode(), partition=int(partition))
    remaining = producer.flush(30)
    if remaining:
        print(json.dumps({"ready": False, "unflushed": remaining}), flush=True)
        return 1
    print(
        json.dumps({"ready": True, "transactional_id": txn_id, "began_at": time.time()}),
        flush=True,
    )
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
