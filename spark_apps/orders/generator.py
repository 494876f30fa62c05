"""Writes order lines to Kafka with a transactional producer (the orders pipeline's input).

Each transaction holds whole orders (1-4 lines each); ``abort_every`` aborts every N-th
transaction (those lines must never reach the database). Two kinds of bad record go in
committed transactions, and the pipeline must quarantine both: ``malformed`` values that
are not JSON, and ``rejected`` lines with a zero quantity, valid JSON that the spec's
transform refuses.

    python -m spark_apps.orders.generator --bootstrap 127.0.0.1:19092 --events 20000
"""

from __future__ import annotations

import argparse
import json
import random
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone

from spark_apps.ledger.generator import ensure_topic, send_transaction, transactional_producer

TOPIC = "orders.events"
SKUS = tuple(f"sku-{n:04d}" for n in range(60))
STORES = ("berlin", "osaka", "seoul", "shanghai", "lyon")


@dataclass
class OrdersSummary:
    """Counts like the ledger's ProduceSummary: ``committed`` valid lines, ``aborted`` lines,
    and the bad records committed beside them (``malformed``, ``rejected``)."""

    committed: int = 0
    aborted: int = 0
    malformed: int = 0
    rejected: int = 0
    transactions: int = 0


def _order(rng: random.Random, seq: int, start: datetime) -> list[tuple[str, bytes]]:
    order_id = str(uuid.UUID(int=rng.getrandbits(128)))
    store = rng.choice(STORES)
    ts = (start + timedelta(milliseconds=seq)).isoformat()
    lines = []
    for line_no in range(1, rng.randint(1, 4) + 1):
        value = {"order_id": order_id, "line_no": line_no, "sku": rng.choice(SKUS), "store": store,
                 "quantity": rng.randint(1, 9), "unit_price_cents": rng.randint(50, 20_000), "ts": ts,
                 "seq": seq + line_no - 1}
        lines.append((order_id, json.dumps(value).encode()))
    return lines


def produce_orders(
    bootstrap: str,
    events: int,
    *,
    topic: str = TOPIC,
    orders_per_transaction: int = 200,
    abort_every: int = 0,
    malformed: int = 0,
    rejected: int = 0,
    seed: int = 11,
    transactional_id: str | None = None,
    first_seq: int = 0,
) -> OrdersSummary:
    """Produces ``events`` committed, valid order lines (plus aborted transactions on top).

    :param bootstrap: Kafka bootstrap servers.
    :param events: valid order lines to commit; the last order is cut short to hit it exactly.
    :param topic: the topic; it must exist (``ensure_topic``).
    :param orders_per_transaction: orders per Kafka transaction.
    :param abort_every: every N-th transaction is aborted (0: none).
    :param malformed: records that are not JSON (dead-lettered by the parser).
    :param rejected: lines with quantity 0, valid JSON that the spec's transform refuses.
    :param seed: the random generator's seed; the same seed gives the same lines.
    :param transactional_id: the producer's transactional.id (default: a fresh one).
    :param first_seq: the first line's ``seq``.
    """
    rng = random.Random(seed)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    producer = transactional_producer(bootstrap, transactional_id or f"orders-gen-{uuid.uuid4().hex[:8]}")
    summary = OrdersSummary()
    seq = first_seq
    while summary.committed < events:
        summary.transactions += 1
        abort = abort_every > 0 and summary.transactions % abort_every == 0
        batch = _orders(rng, seq, start, orders_per_transaction, None if abort else events - summary.committed)
        seq += len(batch)
        good = len(batch)
        if not abort:
            batch += _bad_lines(summary, batch, malformed, rejected)
        send_transaction(producer, topic, batch, abort=abort)
        if abort:
            summary.aborted += len(batch)
        else:
            summary.committed += good
    return summary


def _orders(rng: random.Random, seq: int, start: datetime, orders: int, room: int | None) -> list[tuple[str, bytes]]:
    """The lines of ``orders`` orders from ``seq`` on, cut short at ``room`` lines (None: no bound)."""
    batch: list[tuple[str, bytes]] = []
    for _ in range(orders):
        batch += _order(rng, seq + len(batch), start)
        if room is not None and len(batch) >= room:
            del batch[room:]
            break
    return batch


def _bad_lines(summary: OrdersSummary, good: list[tuple[str, bytes]], malformed: int,
               rejected: int) -> list[tuple[str, bytes]]:
    """One malformed and one rejected line while fewer than asked were sent (a rejected one made
    from the first of the ``good`` lines), counted in ``summary``."""
    bad_lines = []
    if summary.malformed < malformed:
        bad_lines.append((f"malformed-{summary.malformed}", b"{not json"))
        summary.malformed += 1
    if summary.rejected < rejected:
        bad = json.loads(good[0][1])
        bad.update({"order_id": f"rejected-{summary.rejected}", "quantity": 0, "seq": -1 - summary.rejected})
        bad_lines.append((bad["order_id"], json.dumps(bad).encode()))
        summary.rejected += 1
    return bad_lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", default=TOPIC)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--abort-every", type=int, default=5)
    parser.add_argument("--malformed", type=int, default=0)
    parser.add_argument("--rejected", type=int, default=0)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    ensure_topic(args.bootstrap, args.topic, args.partitions)
    summary = produce_orders(args.bootstrap, args.events, topic=args.topic, abort_every=args.abort_every,
                             malformed=args.malformed, rejected=args.rejected, seed=args.seed)
    print(json.dumps(asdict(summary)))


if __name__ == "__main__":
    main()
