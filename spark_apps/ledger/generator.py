"""Writes ledger events to Kafka with a transactional producer.

Each batch of events is one Kafka transaction; ``abort_every`` makes every
N-th batch abort (those records must never reach the database), ``malformed``
and ``poison`` add records the pipeline must quarantine.

    python -m spark_apps.ledger.generator --bootstrap 127.0.0.1:19092 --events 50000
"""

from __future__ import annotations

import argparse
import json
import random
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone

from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from spark_apps.eos_stream.kafka.client_logs import with_python_logging
from spark_apps.ledger.spec import ACCOUNT_ID_MAX

TOPIC = "ledger.events"


@dataclass
class ProduceSummary:
    committed: int = 0
    aborted: int = 0
    malformed: int = 0
    poison: int = 0
    transactions: int = 0


def ensure_topic(bootstrap: str, topic: str = TOPIC, partitions: int = 4, config: dict | None = None) -> None:
    admin = AdminClient(with_python_logging({"bootstrap.servers": bootstrap}))
    futures = admin.create_topics([NewTopic(topic, partitions, 1, config=config or {})])
    try:
        futures[topic].result(30)
    except KafkaException as exc:
        if "TOPIC_ALREADY_EXISTS" not in str(exc) and "already exists" not in str(exc):
            raise


def _event(rng: random.Random, seq: int, accounts: int, start: datetime) -> tuple[str, bytes]:
    account = f"acct-{rng.randrange(accounts):05d}"
    value = {
        "event_id": str(uuid.UUID(int=rng.getrandbits(128))),
        "account_id": account,
        "amount_cents": rng.randint(-5_000, 10_000),
        "ts": (start + timedelta(milliseconds=seq)).isoformat(),
        "seq": seq,
    }
    return account, json.dumps(value).encode()


def produce_ledger(
    bootstrap: str,
    events: int,
    *,
    topic: str = TOPIC,
    accounts: int = 200,
    batch_size: int = 1000,
    abort_every: int = 0,
    malformed: int = 0,
    poison: int = 0,
    seed: int = 7,
    transactional_id: str | None = None,
    first_seq: int = 0,
) -> ProduceSummary:
    """Produces ``events`` committed events (plus aborted batches on top).

    :param abort_every: every N-th transaction is aborted (0: none).
    :param malformed: records that are not valid ledger JSON (dead-lettered).
    :param poison: records valid as JSON whose account id exceeds the target
        column's limit, so the database rejects them on every attempt.
    """
    rng = random.Random(seed)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    producer = transactional_producer(bootstrap, transactional_id or f"ledger-gen-{uuid.uuid4().hex[:8]}")
    summary = ProduceSummary()
    seq = first_seq
    specials = _specials(malformed, poison, start)
    while summary.committed < events:
        summary.transactions += 1
        abort = abort_every > 0 and summary.transactions % abort_every == 0
        size = batch_size if abort else min(batch_size, events - summary.committed)
        batch = [_event(rng, seq + index, accounts, start) for index in range(size)]
        seq += size
        if not abort and specials and summary.transactions % 3 == 1:
            batch.append(_count_special(summary, specials.pop()))
        send_transaction(producer, topic, batch, abort=abort)
        if abort:
            summary.aborted += size
            seq -= size  # aborted events never happened: reuse their sequence numbers
        else:
            summary.committed += size
    for special in specials:  # any not yet placed go in one last transaction
        send_transaction(producer, topic, [_count_special(summary, special)], abort=False)
    return summary


def _specials(malformed: int, poison: int, start: datetime) -> list[tuple[str, bytes]]:
    """The records the pipeline must quarantine: ``malformed`` that are not JSON, ``poison`` whose
    account id the database refuses."""
    specials: list[tuple[str, bytes]] = [("bad", b"{not json") for _ in range(malformed)]
    specials += [
        ("poison", json.dumps({"event_id": str(uuid.uuid4()), "account_id": "x" * (ACCOUNT_ID_MAX + 36),
                               "amount_cents": 1, "ts": start.isoformat(), "seq": -1}).encode())
        for _ in range(poison)
    ]
    return specials


def _count_special(summary: ProduceSummary, special: tuple[str, bytes]) -> tuple[str, bytes]:
    key, _value = special
    summary.malformed += key == "bad"
    summary.poison += key == "poison"
    return special


def transactional_producer(bootstrap: str, transactional_id: str) -> Producer:
    """A producer whose transactions are initialised, batching and compressing as a busy one would."""
    producer = Producer(with_python_logging({
        "bootstrap.servers": bootstrap,
        "transactional.id": transactional_id,
        "linger.ms": 20,
        "compression.type": "lz4",
    }))
    producer.init_transactions(30)
    return producer


def send_transaction(producer: Producer, topic: str, records: list[tuple[str, bytes]], *, abort: bool) -> None:
    """``records`` (key, value) in one Kafka transaction, committed, or aborted when ``abort``."""
    producer.begin_transaction()
    for key, value in records:
        producer.produce(topic, key=key.encode(), value=value)
    if abort:
        producer.flush(30)
        producer.abort_transaction(30)
    else:
        producer.commit_transaction(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", default=TOPIC)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--accounts", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--abort-every", type=int, default=5)
    parser.add_argument("--malformed", type=int, default=0)
    parser.add_argument("--poison", type=int, default=0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    ensure_topic(args.bootstrap, args.topic, args.partitions)
    summary = produce_ledger(
        args.bootstrap, args.events, topic=args.topic, accounts=args.accounts, batch_size=args.batch_size,
        abort_every=args.abort_every, malformed=args.malformed, poison=args.poison, seed=args.seed,
    )
    print(json.dumps(asdict(summary)))


if __name__ == "__main__":
    main()
