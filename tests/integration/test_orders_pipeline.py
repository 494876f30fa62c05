"""The second shipped spec (spark_apps.orders), a shape unlike the ledger's: a two-column aggregate
key, an integer column and a value computed by the spec's transform. Under driver SIGKILLs at random
moments exactly_once ends exact (no duplicate, no loss, every (sku, store) total right, the rejected,
malformed and overflowing lines quarantined and no valid one); the same crashes in at_least_once show
duplicates and wrong totals, so the audit can fail on this shape too. Without the transform's bigint
check the overflowing line fails every batch that holds it (out of range in the staging COPY)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

from spark_apps.ledger.generator import ensure_topic
from spark_apps.orders.generator import produce_orders
from tests.integration.test_crash_matrix import NEGATIVE_CONTROL_KILLS, _crash_once, _kill_plan
from tests.streaming import audit, pipeline_config, run_app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LINES = 6000
# Kills in the exactly_once run: both at the commit and two at random moments.
KILLS = 4
REJECTED = 3
MALFORMED = 2
# Valid fields whose product overflows bigint: only the spec's transform can refuse it.
OVERFLOW = {"order_id": "overflow", "line_no": 1, "sku": "sku-0001", "store": "lyon", "quantity": 9,
            "unit_price_cents": 2**62, "ts": "2026-01-01T00:00:00+00:00", "seq": -100}
BAD = REJECTED + MALFORMED + 1


def _commit(bootstrap: str, topic: str, value: bytes, transactional_id: str) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, key=b"overflow", value=value)
    producer.commit_transaction(30)


@pytest.fixture(scope="module")
def orders_topic(stack: dict) -> str:
    """The order lines both tests read into their own pipelines, produced once: valid, rejected and
    malformed lines in transactions (some aborted), then the overflowing line."""
    bootstrap, topic = stack["EOS_KAFKA_BOOTSTRAP"], f"orders.crash{uuid.uuid4().hex[:10]}"
    ensure_topic(bootstrap, topic, partitions=3)
    produced = produce_orders(bootstrap, LINES, topic=topic, abort_every=4, malformed=MALFORMED, rejected=REJECTED,
                              seed=3, orders_per_transaction=150, transactional_id=f"o{topic}")
    assert produced.committed == LINES and produced.aborted > 0
    assert (produced.rejected, produced.malformed) == (REJECTED, MALFORMED)
    _commit(bootstrap, topic, json.dumps(OVERFLOW).encode(), f"o{topic}-overflow")
    return topic


def _crash_then_audit(stack: dict, tmp_path: Path, topic: str, name: str, delivery: str,
                      kills_planned: int) -> tuple[dict, int]:
    config = pipeline_config(stack, tmp_path, name, delivery=delivery, spec="spark_apps.orders.spec:ORDERS",
                             topics=[topic], max_offsets_per_trigger=700)
    kills = 0
    for index, step in enumerate(_kill_plan(kills_planned, seed=len(name))):
        kills += _crash_once(config, tmp_path, step, label=f"{delivery}-{index}")
    final = run_app(config, tmp_path, label=f"{delivery}-final", timeout=300)
    assert final.process.returncode == 0, final.log()[-3000:]
    return audit(config, tmp_path), kills


def test_orders_exactly_once_under_sigkills(stack, tmp_path, orders_topic, unique_name) -> None:
    report, kills = _crash_then_audit(stack, tmp_path, orders_topic, f"ord{unique_name}", "exactly_once", KILLS)
    summary, sales = report["summary"], report["aggregates"]["sku_store_sales"]
    print(f"orders exactly_once: kills={kills} summary={summary} sales={sales}")
    assert kills >= KILLS  # every run of the plan ends in its kill (_crash_once bounds what each reads)
    assert summary["duplicated"] == 0 and summary["missing"] == 0 and summary["unexpected"] == 0
    assert summary["committed_records"] == LINES + BAD
    assert summary["dead_lettered"] == BAD and summary["wrongly_quarantined"] == 0
    assert summary["malformed_not_quarantined"] == 0
    assert sales["keys_wrong"] == 0 and report["ok"], report["mismatches"]


def test_orders_at_least_once_shows_the_crashes(stack, tmp_path, orders_topic, unique_name) -> None:
    # As the ledger's negative control: the after_commit kill alone makes at_least_once apply a batch
    # twice (committed in the database, not in Spark's checkpoint), so the at-commit kills and one
    # random one are enough.
    report, kills = _crash_then_audit(stack, tmp_path, orders_topic, f"oal{unique_name}", "at_least_once",
                                      NEGATIVE_CONTROL_KILLS)
    summary, sales = report["summary"], report["aggregates"]["sku_store_sales"]
    print(f"orders at_least_once: kills={kills} summary={summary} sales={sales}")
    assert kills >= NEGATIVE_CONTROL_KILLS
    assert summary["duplicated"] > 0 and sales["keys_wrong"] > 0 and not report["ok"]
