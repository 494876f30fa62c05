"""The audit's aggregates mean what the sink's SQL means, on the real stack, without Spark.

The Spark-less replay writes a ``tests.specs.readings`` pipeline: numeric sums of
values a float would round (0.1 ten times is 1.0, exactly), an optional increment
that is often NULL, and timestamps written in several spellings of one instant,
as group keys and as latest values. The audit must be green on that target, and
red on each wrong version of it: a NULL in an increment, a latest timestamp off
by a microsecond, a numeric total off in its last digit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from confluent_kafka import Producer
from psycopg2 import sql

from spark_apps.ledger.generator import ensure_topic
from tests.streaming import audit, pg_connect, pipeline_config, run_direct_replay

pytestmark = pytest.mark.integration

# One instant, four spellings PostgreSQL reads alike.
SPELLINGS = ["2026-03-01T12:00:00Z", "2026-03-01 12:00:00+00", "2026-03-01T13:00:00+01:00",
             "2026-03-01T07:00:00-05:00"]


def _records() -> list[bytes]:
    out = []
    for i in range(120):
        record = {"sensor": f"s{i % 3}", "at": SPELLINGS[i % len(SPELLINGS)], "value": 0.1,
                  "bonus": None if i % 2 else i}
        out.append(json.dumps(record).encode())
    return out


def test_aggregates_mean_in_the_audit_what_they_mean_in_sql(stack: dict, tmp_path: Path, unique_name: str) -> None:
    config = pipeline_config(stack, tmp_path, f"meaning{unique_name}", spec="tests.specs.readings:READINGS")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=1)
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"meaning-{unique_name}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for value in _records():
        producer.produce(topic, value=value, partition=0)
    producer.commit_transaction(30)
    replay = run_direct_replay(config, tmp_path)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]

    target = sql.Identifier(config["target_schema"])
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT sensor, total, bonus_total, n FROM {}.per_sensor ORDER BY 1").format(target))
        # 40 readings of 0.1 each: exactly 4.0 in numeric; bonus only from the even readings, NULL adds nothing.
        assert [(sensor, str(total), bonus, n) for sensor, total, bonus, n in cur.fetchall()] == [
            (f"s{k}", "4.0", sum(i for i in range(k, 120, 3) if i % 2 == 0), 40) for k in range(3)]
        cur.execute(sql.SQL("SELECT count(*), sum(n) FROM {}.per_instant").format(target))
        assert cur.fetchone() == (1, 120)  # four spellings, one key

    def verdict() -> tuple[bool, int | None]:
        report = audit(config, tmp_path)
        return report["ok"], report["aggregates"]["per_sensor"]["keys_wrong"]

    assert verdict() == (True, 0), audit(config, tmp_path)
    wrongs = [
        ("a NULL increment", "UPDATE {}.per_sensor SET bonus_total = NULL WHERE sensor = 's0'",
         "UPDATE {}.per_sensor SET bonus_total = 0 WHERE sensor = 's0'"),
        ("a latest timestamp off by 1 us", "UPDATE {}.per_sensor SET last_at = last_at + interval '1 microsecond'",
         "UPDATE {}.per_sensor SET last_at = last_at - interval '1 microsecond'"),
        ("a numeric total off in its last digit", "UPDATE {}.per_sensor SET total = total + 0.000000001",
         "UPDATE {}.per_sensor SET total = total - 0.000000001"),
    ]
    saved: dict[str, tuple] = {}
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT bonus_total FROM {}.per_sensor WHERE sensor = 's0'").format(target))
        saved["bonus"] = cur.fetchone()
    for name, damage, repair in wrongs:
        with conn.cursor() as cur:
            cur.execute(sql.SQL(damage).format(target))
        assert verdict()[0] is False, name
        with conn.cursor() as cur:
            if name == "a NULL increment":
                cur.execute(sql.SQL("UPDATE {}.per_sensor SET bonus_total = %s WHERE sensor = 's0'").format(target),
                            saved["bonus"])
            else:
                cur.execute(sql.SQL(repair).format(target))
        assert verdict() == (True, 0), f"not green again after repairing {name}"
    conn.close()
