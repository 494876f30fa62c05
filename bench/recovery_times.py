"""Snapshot, restore and replay times of the recovery operators at several data sizes.

    .venv/bin/python bench/recovery_times.py --events 100000 1000000 --runs 3

Per size N: produce N ledger events, process them (availableNow), snapshot
(SnapshotOperator), produce and process N/5 more, request a stop, restore the
snapshot (RestoreOperator: fetch + scratch restore + validate + single-
transaction swap + drop old), replay the N/5 (ReplayOperator), then audit.
``recovery_seconds`` is restore + replay + audit.

The main figure is a pipeline definition's defaults: ``stream.replay_engine``
(``auto``: ``direct`` up to ``stream.replay_direct_max_records`` records to
replay, ``spark`` above) and that threshold, written as
``recovery_<size>_seconds`` (``recovery_100k_seconds``, ``recovery_1m_seconds``), the median of ``--runs`` rounds
(each round runs every size in turn; ``runs_per_size`` keeps every round's figure).
``--engines auto spark direct`` adds the explicit engines side by side, each
on its own pipeline. The load average is recorded: on a shared machine the
numbers are indicative. Each round drops its pipeline's schemas and topic
at its end, so rounds and runs start from the same database. Reads the
stack from ``$EOS_STATE_DIR/stack.env`` (default ``.local``);
``pg_dump``/``psql`` are found as the provider finds them (``[eos]
pg_bin_dir``, else ``PATH``). Writes bench/results/recovery_times.json and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import drop_schemas, git_commit, load_average, machine  # noqa: E402
from bench.harness import STATE_DIR, audit, pg_connect, pipeline_config, read_env_file, run_app  # noqa: E402
from spark_apps.ledger.generator import ensure_topic, produce_ledger  # noqa: E402

PG_CONN, KAFKA_CONN, SPARK_CONN = "eos_bench_pg", "eos_bench_kafka", "eos_bench_spark"


def _connections(stack: dict[str, str]) -> None:
    os.environ[f"AIRFLOW_CONN_{PG_CONN.upper()}"] = json.dumps({
        "conn_type": "postgres", "host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
        "login": stack["EOS_PG_USER"], "password": stack["EOS_PG_PASSWORD"], "schema": stack["EOS_PG_DB"]})
    os.environ[f"AIRFLOW_CONN_{KAFKA_CONN.upper()}"] = json.dumps(
        {"conn_type": "kafka", "extra": {"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"]}})
    os.environ[f"AIRFLOW_CONN_{SPARK_CONN.upper()}"] = json.dumps({"conn_type": "spark", "host": "local[2]"})


def last_run_rate(stack: dict[str, str], config: dict[str, Any]) -> dict[str, Any]:
    """Rows and summed micro-batch time of the pipeline's most recent run."""
    from psycopg2 import sql

    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL(
                "SELECT sum(input_rows), sum(batch_duration_ms), count(*) FROM {} WHERE pipeline = %s"
                " AND run_id = (SELECT run_id FROM {} WHERE pipeline = %s ORDER BY recorded_at DESC LIMIT 1)"
            ).format(*[sql.Identifier(config["meta_schema"], "stream_progress")] * 2),
                (config["pipeline"], config["pipeline"]))
            rows, millis, batches = cur.fetchone()
    finally:
        conn.close()
    return {"rows": int(rows or 0), "batches": int(batches or 0),
            "in_batch_rows_per_s": round(int(rows or 0) / (int(millis) / 1000), 1) if millis else None}


def one_size(stack: dict[str, str], events: int, tmp: Path, engine: str) -> dict[str, Any]:
    from airflow_provider_eos.operators.snapshot import SnapshotOperator

    name = f"bench{uuid.uuid4().hex[:8]}"
    config = pipeline_config(stack, tmp, name, max_offsets_per_trigger=max(20_000, events // 5))
    config_file = tmp / f"{name}.json"
    config_file.write_text(json.dumps(config))
    bootstrap, topic = stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0]
    ensure_topic(bootstrap, topic, partitions=4)
    extra = events // 5
    out: dict[str, Any] = {"events": events, "replayed_events": extra, "engine": engine,
                           "load_average_at_start": load_average()}
    clock = time.monotonic()
    produce_ledger(bootstrap, events, topic=topic, batch_size=5000, seed=1, transactional_id=f"a{name}")
    out["produce_seconds"] = round(time.monotonic() - clock, 1)
    clock = time.monotonic()
    assert run_app(config, tmp, timeout=1800).process.returncode == 0
    out["process_seconds"] = round(time.monotonic() - clock, 1)
    store = tmp / "store"
    # No pg_bin_dir: the hook's own resolution, [eos] pg_bin_dir, else PATH.
    common: dict[str, Any] = {"pipeline_config": str(config_file), "postgres_conn_id": PG_CONN}
    clock = time.monotonic()
    snap = SnapshotOperator(task_id="snapshot", snapshot_store=str(store), keep_last=2, **common).execute({})
    out["snapshot_seconds"] = round(time.monotonic() - clock, 2)
    out["snapshot_rows"] = snap["total_rows"]
    out["dump_mib"] = round(snap["dump_bytes"] / 2**20, 1)
    produce_ledger(bootstrap, extra, topic=topic, batch_size=5000, seed=2, first_seq=events,
                   transactional_id=f"b{name}")
    clock = time.monotonic()
    assert run_app(config, tmp, timeout=1800).process.returncode == 0
    steady_seconds = time.monotonic() - clock
    out["steady"] = {**last_run_rate(stack, config), "seconds": round(steady_seconds, 1),
                     "wall_rows_per_s": round(extra / steady_seconds, 1)}
    out.update(_restore_and_replay(stack, config, common, store, engine, extra, name))
    steady_rate, replay_rate = out["steady"]["in_batch_rows_per_s"], out["replay"]["in_batch_rows_per_s"]
    out["replay_vs_steady_in_batch"] = round(replay_rate / steady_rate, 2) if steady_rate and replay_rate else None
    out["replay_vs_steady_wall"] = round(out["replay"]["wall_rows_per_s"] / out["steady"]["wall_rows_per_s"], 2)
    clock = time.monotonic()
    report = audit(config, tmp)
    out["audit_seconds"] = round(time.monotonic() - clock, 1)
    out["audit_ok"] = report["ok"]
    # What a recovery costs from the restore on: restore + replay + audit.
    out["recovery_seconds"] = round(out["restore_seconds"] + out["replay_seconds"] + out["audit_seconds"], 1)
    _forget(stack, config)
    return out


def _restore_and_replay(stack: dict[str, str], config: dict[str, Any], common: dict[str, Any], store: Path,
                        engine: str, extra: int, name: str) -> dict[str, Any]:
    """The stream stopped, the snapshot restored and the ``extra`` events since it replayed: each
    step's time, and the replay's rates."""
    from airflow_provider_eos.hooks.pg_tools import PgToolsHook
    from airflow_provider_eos.operators.replay import ReplayOperator
    from airflow_provider_eos.operators.restore import RestoreOperator
    from airflow_provider_eos.state.stop_requests import set_stop_request
    from airflow_provider_eos.utils.pipeline_definition import StreamSettings

    out: dict[str, Any] = {}
    hook = PgToolsHook(postgres_conn_id=PG_CONN, meta_schema=config["meta_schema"])
    set_stop_request(hook, config["pipeline"], True)
    clock = time.monotonic()
    restored = RestoreOperator(task_id="restore", snapshot_store=str(store), quiet_seconds=0, release_lock=True,
                               kafka_config_id=KAFKA_CONN, **common).execute({"run_id": f"bench-{name}"})
    out["restore_seconds"] = round(time.monotonic() - clock, 2)
    out["restore_phases"] = restored["timings"]
    clock = time.monotonic()
    replayed = ReplayOperator(task_id="replay", kafka_config_id=KAFKA_CONN, spark_conn_id=SPARK_CONN,
                              jars=stack["EOS_SPARK_JARS"], engine=engine,
                              direct_max_records=StreamSettings().replay_direct_max_records,
                              **common).execute({"run_id": f"bench-{name}"})
    out["replay_seconds"] = round(time.monotonic() - clock, 1)
    out["replay_events_counted"] = replayed["events_replayed"]
    out["replay_choice"] = replayed["engine"]
    # The direct replay writes no progress rows (no Spark): only its wall clock compares.
    ran = replayed["engine"]["engine"]
    in_batch = last_run_rate(stack, config) if ran == "spark" else {"in_batch_rows_per_s": None}
    out["replay"] = {**in_batch, "seconds": out["replay_seconds"],
                     "wall_rows_per_s": round(extra / out["replay_seconds"], 1)}
    return out


def _forget(stack: dict[str, str], config: dict[str, Any]) -> None:
    """Drops the round's schemas and topic: the next rounds (and runs) start from the same
    database, not one grown by a million rows a round."""
    from confluent_kafka.admin import AdminClient

    conn = pg_connect(stack)
    try:
        drop_schemas(conn, config["target_schema"], config["meta_schema"])
    finally:
        conn.close()
    admin = AdminClient({"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"]})
    for future in admin.delete_topics(list(config["topics"]), operation_timeout=60).values():
        future.result()


def size_label(events: int) -> str:
    """100000 -> "100k", 1000000 -> "1m": the figure's name."""
    return f"{events // 10**6}m" if events >= 10**6 and events % 10**6 == 0 else f"{events // 1000}k"


def main() -> None:
    from airflow_provider_eos.utils.pipeline_definition import StreamSettings
    from airflow_provider_eos.utils.replay_engine import REPLAY_ENGINE_CHOICES

    defaults = StreamSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--engines", nargs="+", choices=REPLAY_ENGINE_CHOICES, default=[defaults.replay_engine],
                        help="replay engines, side by side (default: the definition's default)")
    parser.add_argument("--runs", type=int, default=1,
                        help="rounds over the sizes; each headline figure is the median of its rounds")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "recovery_times.json"))
    args = parser.parse_args()
    stack = read_env_file(STATE_DIR / "stack.env")
    os.environ.update(stack)
    _connections(stack)
    results = []
    for round_ in range(args.runs):
        for events in args.events:
            for engine in args.engines:
                with tempfile.TemporaryDirectory(prefix="eos-bench-recovery-") as tmp:
                    result = {"round": round_, **one_size(stack, events, Path(tmp), engine)}
                print(json.dumps(result), flush=True)
                results.append(result)
    # The main figures: the definition's defaults, one per size, the median of its rounds.
    per_size: dict[str, list[float]] = {}
    for r in results:
        if r["engine"] == defaults.replay_engine:
            per_size.setdefault(f"recovery_{size_label(r['events'])}_seconds", []).append(r["recovery_seconds"])
    headline = {name: round(statistics.median(runs), 1) for name, runs in per_size.items()}
    document = {**headline, "runs_per_size": per_size, "code": git_commit(ROOT),
                "defaults": {"replay_engine": defaults.replay_engine,
                             "replay_direct_max_records": defaults.replay_direct_max_records},
                "indicative": "a shared 2-core machine: see each result's load_average_at_start",
                "load_average_at_end": load_average(),
                "machine": machine(), "spark_master": "local[2]", "results": results}
    Path(args.output).write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(headline))
    print(f"{'events':>9} {'engine':>12} {'snap rows':>10} {'dump MiB':>8} {'snapshot s':>10} {'restore s':>9} "
          f"{'replayed':>9} {'replay s':>8} {'steady r/s':>10} {'replay r/s':>10} {'ratio':>5} {'audit':>5} "
          f"{'recovery s':>10}")
    for r in results:
        engine = f"{r['engine']}:{r['replay_choice']['engine']}"  # asked:ran
        print(f"{r['events']:>9} {engine:>12} {r['snapshot_rows']:>10} {r['dump_mib']:>8} "
              f"{r['snapshot_seconds']:>10} "
              f"{r['restore_seconds']:>9} {r['replayed_events']:>9} {r['replay_seconds']:>8} "
              f"{r['steady']['in_batch_rows_per_s']!s:>10} {r['replay']['in_batch_rows_per_s']!s:>10} "
              f"{r['replay_vs_steady_in_batch']!s:>5} {r['audit_ok']!s:>5} {r['recovery_seconds']:>10}")


if __name__ == "__main__":
    main()
