"""The audit read by worker processes gives the report one process gives, on the real stack.

One process (``workers=1``) reads and judges every partition itself, as the audit always
did; with workers each reads a share and the parent merges their sides. The reports must
be the same JSON, byte for byte, on a right target and on wrong ones; a timeout must name
the unfinished partitions, a worker's failure must reach the caller as an error, and no
worker process may outlive the audit in either case.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from psycopg2 import sql

from spark_apps.eos_stream.audit.oracle import audit
from spark_apps.eos_stream.audit.rules import AuditTimeout
from spark_apps.eos_stream.records.spec import load_spec
from spark_apps.eos_stream.run.config import PipelineConfig, parse_args
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.streaming import pg_connect, pipeline_config, run_direct_replay

pytestmark = pytest.mark.integration

PARTITIONS = 4


def _config(config: dict[str, Any], tmp_path: Path) -> PipelineConfig:
    path = tmp_path / f"{config['pipeline']}-parallel.json"
    path.write_text(json.dumps(config))
    return parse_args(["--config", str(path)])


def _spread(bootstrap: str, topic: str, count: int, txn_id: str) -> None:
    """Ledger events with their accounts in every partition (not keyed), so an account's
    latest value and totals come from several partitions, and workers, at once."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id})
    producer.init_transactions(30)
    producer.begin_transaction()
    for seq in range(10_000, 10_000 + count):
        value = {"event_id": f"sp-{seq}", "account_id": f"acct-{seq % 7:05d}", "amount_cents": seq % 500 - 200,
                 "ts": "2026-02-01T00:00:00+00:00", "seq": seq}
        producer.produce(topic, value=json.dumps(value).encode(), partition=seq % PARTITIONS)
    producer.commit_transaction(30)


def _own_workers() -> set[int]:
    """This process's children running the audit's worker."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"eos_stream.audit.worker" in cmdline:
            found.add(int(entry.name))
    return found


def _reports(config: PipelineConfig, **kwargs: Any) -> dict[int, str]:
    """The audit's JSON report read by 1, 2 and 3 processes."""
    spec = load_spec(config.spec)
    out = {workers: json.dumps(audit(config, spec, workers=workers, **kwargs), indent=2, sort_keys=True, default=str)
           for workers in (1, 2, 3)}
    assert not _own_workers()
    return out


def test_workers_give_the_report_one_process_gives(stack: dict, tmp_path: Path, unique_name: str) -> None:
    raw = pipeline_config(stack, tmp_path, f"apar{unique_name}")
    topic, bootstrap = raw["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=PARTITIONS)
    produce_ledger(bootstrap, 6000, topic=topic, abort_every=5, malformed=3, poison=2, batch_size=400, seed=31,
                   transactional_id=f"ap{unique_name}")
    _spread(bootstrap, topic, 800, f"as{unique_name}")
    replay = run_direct_replay(raw, tmp_path)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    config = _config(raw, tmp_path)

    right = _reports(config)
    report = json.loads(right[1])
    print(f"\nright target: ok={report['ok']} {report['summary']}")
    assert report["ok"] and report["summary"]["committed_records"] == 6805
    assert report["summary"]["dead_lettered"] == 5
    assert right[2] == right[1] and right[3] == right[1]

    # A tail the stopped pipeline did not apply: missing, or allowed.
    _spread(bootstrap, topic, 40, f"at{unique_name}")
    tail = _reports(config)
    allowed = _reports(config, pending="allowed")
    assert not json.loads(tail[1])["ok"] and json.loads(tail[1])["summary"]["missing"] == 40
    assert json.loads(allowed[1])["ok"]
    assert tail[2] == tail[1] == tail[3] and allowed[2] == allowed[1] == allowed[3]

    # Wrong targets: a row lost, a row twice, a balance and an account's latest seq off.
    target = sql.Identifier(raw["target_schema"])
    conn = pg_connect(stack)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DELETE FROM {t}.ledger_events WHERE ctid = (SELECT ctid FROM {t}.ledger_events"
                            " WHERE kafka_partition = 1 LIMIT 1)").format(t=target))
        cur.execute(sql.SQL("INSERT INTO {t}.ledger_events SELECT * FROM {t}.ledger_events"
                            " WHERE kafka_partition = 2 LIMIT 1").format(t=target))
        cur.execute(sql.SQL("UPDATE {t}.account_balances SET balance_cents = balance_cents + 1, last_seq = 1"
                            " WHERE account_id = 'acct-00003'").format(t=target))
    conn.close()
    wrong = _reports(config, pending="allowed")
    report = json.loads(wrong[1])
    print(f"wrong target: mismatches={report['mismatches']}")
    assert not report["ok"] and report["summary"]["missing"] == 1 and report["summary"]["duplicated"] == 1
    assert "account_balances" in report["mismatches"]
    assert wrong[2] == wrong[1] and wrong[3] == wrong[1]


def test_workers_time_out_naming_the_partitions_and_fail_loudly(stack: dict, tmp_path: Path,
                                                                unique_name: str) -> None:
    raw = pipeline_config(stack, tmp_path, f"apto{unique_name}")
    topic, bootstrap = raw["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=PARTITIONS)
    produce_ledger(bootstrap, 2000, topic=topic, batch_size=500, seed=32, transactional_id=f"at{unique_name}")
    replay = run_direct_replay(raw, tmp_path)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    config = _config(raw, tmp_path)
    spec = load_spec(config.spec)

    with pytest.raises(AuditTimeout) as caught:
        audit(config, spec, workers=2, timeout=0.001)
    message = str(caught.value)
    print(f"\nwith workers and timeout 0.001: {message[:300]}")
    assert message.startswith("audit timed out after 0.001s reading Kafka; 4 partition(s) did not finish: ")
    assert [(u["topic"], u["partition"]) for u in caught.value.unfinished] == [(topic, p) for p in range(4)]
    assert not _own_workers()

    # A spec whose module this process has and a worker cannot import: the worker's error, raised here.
    module = types.ModuleType(f"eos_unimportable_{unique_name}")

    def unchanged(record: dict) -> dict:
        return record

    unchanged.__module__, unchanged.__qualname__ = module.__name__, "unchanged"
    module.unchanged = unchanged  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(RuntimeError) as failed:
            audit(config, dataclasses.replace(spec, transform=unchanged), workers=2)
    finally:
        del sys.modules[module.__name__]
    print(f"with a spec the workers cannot import: {str(failed.value).splitlines()[0]}")
    assert "failed in worker process" in str(failed.value)
    assert f"No module named '{module.__name__}'" in str(failed.value)
    assert not _own_workers()

    # A worker killed before it answers: the audit fails at once, naming it, and stops the other.
    # The workers' spec comes from a module that holds them when they import it (it sleeps in
    # children of this process only), so no worker can answer before the kill, however fast.
    held = f"eos_held_{unique_name}"
    (tmp_path / f"{held}.py").write_text(f"import os, time\nif os.getppid() == {os.getpid()}:\n    time.sleep(600)\n"
                                         "\n\ndef unchanged(record):\n    return record\n")
    sys.path.insert(0, str(tmp_path))
    try:
        holding = dataclasses.replace(spec, transform=importlib.import_module(held).unchanged)
    finally:
        sys.path.remove(str(tmp_path))

    def kill_first_worker() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            started = _own_workers()
            if started:
                os.kill(min(started), signal.SIGKILL)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_first_worker)
    killer.start()
    sys.path.insert(0, str(tmp_path))  # the workers get this process's path
    try:
        with pytest.raises(RuntimeError) as died:
            audit(config, holding, workers=2)
    finally:
        sys.path.remove(str(tmp_path))
        del sys.modules[held]
    killer.join()
    print(f"with a worker killed: {died.value}")
    assert "closed its output without an answer (exit code -9)" in str(died.value)
    assert not _own_workers()
