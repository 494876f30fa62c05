"""The database is the judge: a corpus of nasty records on every write path and on the replay.

Valid ledger events are committed to Kafka around one transaction of records
built to hurt: values PostgreSQL refuses although they are JSON of the right
shape (a timestamp offset past 15:59, a date that does not exist, integers past
bigint, text past ``varchar(64)``), bytes the parser cannot read (invalid UTF-8,
nesting past the recursion limit, a 5,000-digit integer, NUL, a lone surrogate),
and edge values PostgreSQL accepts (bigint's bounds, an offset of 15:59, text
full of escapes). Each path must converge in one run (two counted attempts, then
the batch's records isolated in the same driver): every refused record is
quarantined with its coordinates, raw bytes and, for the database's refusals,
its SQLSTATE; nothing else is; the audit is exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Producer
from psycopg2 import sql

from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.streaming import ROOT, audit, pg_connect, pipeline_config, run_app

pytestmark = pytest.mark.integration

GOOD = {"account_id": "acct-nasty", "amount_cents": 1, "ts": "2026-01-01T00:00:00+00:00", "seq": 1}

# key -> (value, the SQLSTATE class its dead letter must carry: "22" from the database, None from the parser)
REFUSED: dict[str, tuple[bytes | None, str | None]] = {
    "tz-past-15:59": (json.dumps({**GOOD, "event_id": "n1", "ts": "2026-01-01T00:00:00+16:00"}).encode(), "22"),
    "no-such-date": (json.dumps({**GOOD, "event_id": "n2", "ts": "2023-02-30T00:00:00Z"}).encode(), "22"),
    "hour-25": (json.dumps({**GOOD, "event_id": "n3", "ts": "2026-01-01T25:00:00Z"}).encode(), "22"),
    "not-a-time": (json.dumps({**GOOD, "event_id": "n4", "ts": "half past nine"}).encode(), "22"),
    "past-bigint": (json.dumps({**GOOD, "event_id": "n5", "amount_cents": 2**63}).encode(), "22"),
    "below-bigint": (json.dumps({**GOOD, "event_id": "n6", "amount_cents": -(2**63) - 1}).encode(), "22"),
    "huge-seq": (json.dumps({**GOOD, "event_id": "n7", "seq": 10**30}).encode(), "22"),
    "long-account": (json.dumps({**GOOD, "event_id": "n8", "account_id": "x" * 65}).encode(), "22"),
    "invalid-utf8": (b'{"event_id": "\xff\xfe", "account_id": "a"}', None),
    "deep-nesting": (b'{"event_id": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),
    "5000-digits": (b'{"event_id": "n9", "amount_cents": ' + b"9" * 5000 + b"}", None),
    "nul-in-text": (json.dumps({**GOOD, "event_id": "n\u0000"}).encode(), None),
    "lone-surrogate": (b'{"event_id": "\\ud800", "account_id": "a", "amount_cents": 1, "ts": "x", "seq": 1}', None),
    "float-amount": (json.dumps({**GOOD, "event_id": "n10", "amount_cents": 1.5}).encode(), None),
    "tombstone": (None, None),
}
# Edge values the database takes: each lands once, in its own account so no sum overflows.
ACCEPTED = {
    "bigint-max": {**GOOD, "event_id": "e1", "account_id": "edge-max", "amount_cents": 2**63 - 1},
    "bigint-min": {**GOOD, "event_id": "e2", "account_id": "edge-min", "amount_cents": -(2**63)},
    "tz-15:59": {**GOOD, "event_id": "e3", "account_id": "edge-tz", "ts": "2026-01-01T00:00:00-15:59"},
    "escapes": {**GOOD, "event_id": "e4\t\\n\n\r\\", "account_id": "edge-esc"},
    "64-chars": {**GOOD, "event_id": "e5", "account_id": "é" * 64},
    "leap-day": {**GOOD, "event_id": "e6", "account_id": "edge-leap", "ts": "2024-02-29 23:59:59.999999+05:30"},
}
VALID_EVENTS = 1200


@pytest.fixture(scope="module")
def corpus_topic(stack: dict[str, str]) -> str:
    """One topic for every path: valid events, the nasty transaction, more valid events."""
    import uuid

    topic = f"ledger.nasty{uuid.uuid4().hex[:8]}"
    bootstrap = stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=2)
    produce_ledger(bootstrap, VALID_EVENTS // 2, topic=topic, seed=31)
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"nasty-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for key, (value, _) in REFUSED.items():
        producer.produce(topic, key=key.encode(), value=value)
    for key, record in ACCEPTED.items():
        producer.produce(topic, key=key.encode(), value=json.dumps(record).encode())
    producer.commit_transaction(30)
    produce_ledger(bootstrap, VALID_EVENTS // 2, topic=topic, seed=32, first_seq=10_000)
    return topic


def _replay(config: dict, tmp_path: Path) -> int:
    path = tmp_path / f"{config['pipeline']}-replay.json"
    path.write_text(json.dumps(config))
    replay = "spark_apps.eos_stream.engines.direct_replay"
    result = subprocess.run([sys.executable, "-m", replay, "--config", str(path)], capture_output=True, text=True,
                            cwd=ROOT, env=dict(os.environ), timeout=300)
    (tmp_path / "replay.log").write_text(result.stdout + result.stderr)
    return result.returncode


@pytest.mark.parametrize(
    ("engine", "delivery"),
    [
        ("spark", "exactly_once"),
        ("spark", "two_phase"),  # PREPARE around isolation
        ("replay", "exactly_once"),
    ],
)
def test_every_refused_record_is_quarantined_and_the_rest_is_exact(
    stack: dict, tmp_path: Path, unique_name: str, corpus_topic: str,
    engine: str, delivery: str,
) -> None:
    config = pipeline_config(stack, tmp_path, f"nasty{unique_name}", topics=[corpus_topic], delivery=delivery,
                             max_offsets_per_trigger=500,
                             max_batch_attempts=2)
    if engine == "spark":
        run = run_app(config, tmp_path)
        code, log = run.process.returncode, run.log()
        # The poisoned batch: max_batch_attempts counted data failures, then isolation, in this driver.
        retries = run.events("retry")
        assert retries and {event["error_class"] for event in retries} == {"data"}, log[-4000:]
        per_batch = Counter(event["batch_id"] for event in retries)
        assert set(per_batch.values()) == {2}, per_batch  # each poisoned batch: exactly max_batch_attempts
        assert any(event["record_by_record"] for event in run.events("batch"))
    else:
        code = _replay(config, tmp_path)
        log = (tmp_path / "replay.log").read_text()
    # One run converges: the poisoned batch is retried and isolated in the driver, no restart needed.
    assert code == 0, log[-4000:]

    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT convert_from(key, 'UTF8'), topic, partition, \"offset\", sqlstate, error,"
                            " value IS NOT NULL FROM {}.dead_letters").format(sql.Identifier(config["meta_schema"])))
        dead = {row[0]: row[1:] for row in cur.fetchall()}
        cur.execute(sql.SQL("SELECT count(*) FROM {}.ledger_events WHERE account_id LIKE 'edge-%%'"
                            " OR account_id = %s").format(sql.Identifier(config["target_schema"])), ("é" * 64,))
        (edges,) = cur.fetchone()
    conn.close()
    assert set(dead) == set(REFUSED), {"unexpected": set(dead) - set(REFUSED), "missed": set(REFUSED) - set(dead)}
    for key, (value, sqlstate_class) in REFUSED.items():
        topic, partition, offset, sqlstate, error, has_value = dead[key]
        assert topic == corpus_topic and partition in (0, 1) and offset >= 0, (key, dead[key])
        assert has_value == (value is not None), key  # the raw bytes travel with the dead letter
        if sqlstate_class is None:
            assert sqlstate is None, (key, sqlstate, error)
        else:
            assert sqlstate and sqlstate.startswith(sqlstate_class), (key, sqlstate, error)
            assert "rejected by the database" in error, (key, error)
    assert edges == len(ACCEPTED)
    report = audit(config, tmp_path)
    assert report["ok"], report
    assert report["summary"]["dead_lettered"] == len(REFUSED)
