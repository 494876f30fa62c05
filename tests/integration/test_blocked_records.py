"""Issue test 3 on the real app: a foreign key whose parent rows arrive after the child events.

The ledger's events reference accounts that nobody has created yet. A foreign
key violation (23503) is not the record's fault, so nothing is quarantined:
the run retries, then fails loudly, naming the batch's offsets and the
database's error (not Spark's query identifier). Once the parents exist, the
next run applies every event once and the audit is exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from psycopg2 import sql

from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.sink.modes import MODES
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from spark_apps.ledger.spec import LEDGER
from tests.streaming import audit, dead_letter_count, ledger_rows, pg_connect, pipeline_config, run_app

pytestmark = pytest.mark.integration


def test_children_before_their_parents_are_never_quarantined(stack: dict, tmp_path: Path, unique_name: str) -> None:
    # The retry window counts from the batch's start, its first attempt's staging by Spark tasks
    # (a fresh JVM's Python workers) included: 20 s leaves room for a retry on a loaded machine.
    config = pipeline_config(stack, tmp_path, f"fk{unique_name}", transient_retry_seconds=20,
                             max_batch_attempts=1)
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=2)
    produce_ledger(bootstrap, 400, topic=topic, accounts=20, seed=41)
    conn = pg_connect(stack)
    conn.autocommit = False
    preflight.create_targets(conn, LEDGER, config["target_schema"], MODES["exactly_once"])
    target = sql.Identifier(config["target_schema"])
    with conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE TABLE {}.accounts (account_id varchar(64) PRIMARY KEY)").format(target))
        cur.execute(sql.SQL("ALTER TABLE {t}.ledger_events ADD FOREIGN KEY (account_id) REFERENCES {t}.accounts")
                    .format(t=target))
    conn.commit()
    conn.autocommit = True

    blocked = run_app(config, tmp_path, label="blocked")
    assert blocked.process.returncode == 1, blocked.log()[-3000:]
    retries = blocked.events("retry")
    assert retries and all(r["error_class"] == "blocked" and r["sqlstate"] == "23503" for r in retries), \
        blocked.log()[-3000:]
    message = blocked.events("error")[-1]["message"]
    assert message.startswith("BatchBlocked: batch 0 (offsets "), message
    assert "SQLSTATE 23503" in message and "parent rows" in message and "Identifier:" not in message
    assert dead_letter_count(conn, config) == 0 and ledger_rows(stack, config["target_schema"]) == 0

    with conn.cursor() as cur:
        cur.execute(sql.SQL("INSERT INTO {}.accounts SELECT 'acct-' || lpad(n::text, 5, '0')"
                            " FROM generate_series(0, 19) n").format(target))
    landed = run_app(config, tmp_path, label="landed")
    assert landed.process.returncode == 0, landed.log()[-3000:]
    assert dead_letter_count(conn, config) == 0 and ledger_rows(stack, config["target_schema"]) == 400
    conn.close()
    report = audit(config, tmp_path)
    assert report["ok"], report
