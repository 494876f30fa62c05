"""Test support: the local stack's harness (``bench/harness.py``, shared with the benchmarks, which
import nothing of the tests) and what only the tests use: pipeline definitions of an app config,
dead letters, the ledger's order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.harness import (
    APP,
    ROOT,
    SPARK_SUBMIT,
    AppRun,
    audit,
    ledger_rows,
    pg_connect,
    pipeline_config,
    run_app,
    run_direct_replay,
    spark_submit,
    start_app,
    start_continuous,
)

__all__ = ["APP", "ROOT", "SPARK_SUBMIT", "AppRun", "audit", "dead_letter_count", "definition_of", "ledger_order",
           "ledger_rows", "pg_connect", "pipeline_config", "run_app", "run_direct_replay", "spark_submit",
           "start_app", "start_continuous", "write_definition"]


def definition_of(config: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """The pipeline definition (airflow_provider_eos.utils.pipeline_definition), as a dict, of an
    app ``config`` made by :func:`pipeline_config`, with ``sections`` (stream, health, snapshot...)
    merged over what the config implies. Kafka and the database come from the connections."""
    stream = {key: config[key] for key in ("engine", "trigger", "trigger_interval", "max_offsets_per_trigger",
                                           "max_batch_attempts", "create_targets") if key in config}
    definition: dict[str, Any] = {
        "name": config["pipeline"],
        "topics": list(config["topics"]),
        "spec": config["spec"],
        "delivery": config["delivery"],
        "target_schema": config["target_schema"],
        "meta_schema": config["meta_schema"],
        "checkpoint_dir": config["checkpoint_dir"],
        "stream": {**stream, **sections.pop("stream", {})},
        **sections,
    }
    return definition


def write_definition(config: dict[str, Any], directory: Path, **sections: dict[str, Any]) -> Path:
    """``<directory>/<pipeline>.yaml``: :func:`definition_of` ``config`` and ``sections``."""
    definition = definition_of(config, **sections)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{config['pipeline']}.yaml"
    path.write_text(json.dumps(definition, indent=2))  # JSON is YAML
    return path


def dead_letter_count(conn, config: dict[str, Any]) -> int:
    """Dead letters the pipeline of ``config`` has quarantined."""
    from psycopg2 import sql

    from spark_apps.eos_stream.state import meta_tables

    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT count(*) FROM {} WHERE pipeline = %s").format(
            meta_tables.table(config["meta_schema"], meta_tables.DEAD_LETTERS)), (config["pipeline"],))
        (count,) = cur.fetchone()
    return int(count)


def ledger_order(stack: dict[str, str], schema: str) -> dict[str, int]:
    """Order in ``<schema>.ledger_events``, as docs/ordering.md states it: each account's
    events, taken in Kafka order (partition, offset), have strictly increasing ``seq``
    (the generator numbers committed events in production order).

    :return: ``accounts``; ``split_accounts``, accounts whose events span partitions
        (0 on a topic keyed by account); ``out_of_order_accounts``, accounts with an
        event whose seq is not above its predecessor's (a duplicate counts: it repeats one).
    """
    from psycopg2 import sql

    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL(
                "SELECT count(DISTINCT account_id),"
                " count(DISTINCT account_id) FILTER (WHERE previous IS NOT NULL AND seq <= previous),"
                " (SELECT count(*) FROM (SELECT 1 FROM {t} GROUP BY account_id"
                "  HAVING count(DISTINCT kafka_partition) > 1) split)"
                " FROM (SELECT account_id, seq, lag(seq) OVER (PARTITION BY account_id"
                "       ORDER BY kafka_partition, kafka_offset) AS previous FROM {t}) ordered"
            ).format(t=sql.Identifier(schema, "ledger_events")))
            accounts, out_of_order, split = cur.fetchone()
            return {"accounts": accounts, "split_accounts": split, "out_of_order_accounts": out_of_order}
    finally:
        conn.close()
