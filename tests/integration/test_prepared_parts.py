"""Each row written once, as prepared parts (``sink.parts``, transitions P1-P6 in
``batch_sink``), on the real Kafka and PostgreSQL.

The parts are written by ``part_writer.write_part``, the function each Spark task
runs, here called once per partition as two tasks would; the crash matrix
(``test_crash_matrix``) kills the real app at the decision's commit. Each
transition test has its negative control: the resolution a build without the
decision table would do, which the audit must call wrong.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from psycopg2 import sql

from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.records.spec import AggregateTarget, Field, PipelineSpec, RowTarget
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.sink import parts
from spark_apps.eos_stream.sink.batch_sink import BatchSink
from spark_apps.eos_stream.sink.in_doubt import resolve_in_doubt
from spark_apps.eos_stream.sink.modes import MODES
from spark_apps.eos_stream.sink.part_writer import write_part
from spark_apps.eos_stream.sink.settings import SinkSettings
from spark_apps.eos_stream.sink.staging import stage_ranges
from spark_apps.eos_stream.state import fencing
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from spark_apps.ledger.spec import LEDGER
from tests.streaming import audit, pg_connect, pipeline_config, run_app

pytestmark = pytest.mark.integration

# Nulls, a key's last value NULL, sums past 64 bits, \u escapes (Python's path, not Arrow's),
# a key in both partitions: everything where summing outside the database could differ from it.
TRICKY = PipelineSpec(
    name="tricky",
    fields=(Field("k", "text"), Field("v", "bigint", required=False), Field("s", "bigint", required=False),
            Field("flag", "boolean", required=False)),
    targets=(RowTarget("ev", ("k", "v", "s", "flag")),
             AggregateTarget("agg", group_by=("k",), increments={"total": "v", "n": None},
                             latest={"last_s": "s", "last_flag": "flag"})),
)
_BIG = 2**62


def _tricky_values() -> list[tuple[int, bytes]]:
    """(partition, value) of each record, in produce order."""
    out = []
    for i in range(3000):
        key = f"k{i % 37}" if i % 5 else f"\\u00e9t\\u00e9{i % 3}"  # escaped: Python parses these
        v = "null" if i % 11 == 0 else str(_BIG if i % 7 == 0 else i - 1500)
        s = "null" if i % 13 == 0 else str(i)
        flag = ["true", "false", "null"][i % 3]
        out.append((i % 2, f'{{"k": "{key}", "v": {v}, "s": {s}, "flag": {flag}}}'.encode()))
    return out


def _produce(bootstrap: str, topic: str, values: list[tuple[int, bytes]]) -> dict[tuple[str, int], int]:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for partition, value in values:
        producer.produce(topic, value=value, partition=partition)
    assert producer.flush(30) == 0
    ends: dict[tuple[str, int], int] = {}
    for partition, _ in values:
        ends[(topic, partition)] = ends.get((topic, partition), 0) + 1
    return ends


def _targets(conn, schema: str) -> None:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        cur.execute(sql.SQL(
            "CREATE TABLE {}.ev (kafka_topic text, kafka_partition integer, kafka_offset bigint, k text, v bigint,"
            " s bigint, flag boolean)").format(sql.Identifier(schema)))
        cur.execute(sql.SQL(
            "CREATE TABLE {}.agg (k text PRIMARY KEY, total numeric, n bigint, last_s bigint, last_flag boolean)"
        ).format(sql.Identifier(schema)))
    conn.commit()


class _Pipeline:
    """A sink over its own schemas, with an epoch, as a claimed driver has."""

    def __init__(self, stack: dict, spec: PipelineSpec, target: str, meta: str, name: str) -> None:
        self.stack, self.spec, self.target, self.meta, self.name = stack, spec, target, meta, name
        self.conn, self.guard = pg_connect(stack), pg_connect(stack)
        self.conn.autocommit = False
        preflight.ensure_meta_tables(self.conn, meta)
        self.epoch = fencing.bump_epoch(self.conn, meta, name, by="test", reason="test")
        settings = SinkSettings(spec=spec, mode=MODES["exactly_once"], pipeline=name, target_schema=target,
                                meta_schema=meta, max_batch_attempts=3, epoch=self.epoch, transient_retry_seconds=10,
                                prepared_parts=True)
        self.sink = BatchSink(settings, conn=self.conn, guard_conn=self.guard)

    def dsn(self) -> dict[str, Any]:
        return {"host": self.stack["EOS_PG_HOST"], "port": int(self.stack["EOS_PG_PORT"]),
                "dbname": self.stack["EOS_PG_DB"], "user": self.stack["EOS_PG_USER"],
                "password": self.stack["EOS_PG_PASSWORD"]}

    def write(self, bootstrap: str, ends: dict[tuple[str, int], int], batch_id: int = 0) -> parts.WrittenParts:
        """The batch of ``ends`` (from offset 0) written as one part per partition, as two tasks would."""
        settings = kafka_ranges.consumer_settings(bootstrap, {}, f"test-{self.name}")
        prefix = self.sink.parts_prefix(batch_id)
        results = []
        for index, r in enumerate(kafka_ranges.offset_ranges({tp: kafka_ranges.EARLIEST for tp in ends}, ends)):
            consumer = kafka_ranges.worker_consumer(settings)
            results.append(write_part(self.dsn(), self.spec, self.target, f"{prefix}{index}:0", consumer, [r]))
        kafka_ranges.drop_worker_consumer(settings)
        written = parts.gather(results, self.spec, prefix, 0)
        assert isinstance(written, parts.WrittenParts), written
        return written

    def decide_only(self, written: parts.WrittenParts, ends: dict[tuple[str, int], int], batch_id: int = 0) -> None:
        """The decision committed and no part committed: a driver killed right after its
        decision's COMMIT (P4)."""
        with self.conn.cursor() as cur:
            self.sink.offsets.lock(cur)
            parts.decide(cur, self.spec, self.target, self.meta, self.name, batch_id, written)
            self.sink.offsets.advance(cur, ends, batch_id)
        self.conn.commit()

    def close(self) -> None:
        self.conn.rollback()
        parts.roll_back(self.conn, parts.pipeline_prefix(self.name))
        for conn in (self.conn, self.guard):
            conn.close()


def _rows(conn, schema: str, table: str, order: str) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT * FROM {}.{} ORDER BY {}").format(
            sql.Identifier(schema), sql.Identifier(table), sql.SQL(order)))
        rows = cur.fetchall()
    conn.commit()
    return rows


def test_parts_write_what_the_staged_apply_writes(stack: dict, unique_name: str) -> None:
    """The same batch, once staged and applied in SQL, once as parts whose aggregate deltas were
    summed in the tasks: the same rows and the same aggregates, to the last NULL and past 64 bits."""
    bootstrap = stack["EOS_KAFKA_BOOTSTRAP"]
    topic = f"tricky.{unique_name}"
    ensure_topic(bootstrap, topic, partitions=2)
    ends = _produce(bootstrap, topic, _tricky_values())
    conn = pg_connect(stack)
    staged_schema, parts_schema = f"t_st{unique_name}", f"t_pt{unique_name}"
    _targets(conn, staged_schema)
    _targets(conn, parts_schema)
    staged = _Pipeline(stack, TRICKY, staged_schema, f"m_st{unique_name}", f"st{unique_name}")
    written = _Pipeline(stack, TRICKY, parts_schema, f"m_pt{unique_name}", f"pt{unique_name}")
    try:
        settings = kafka_ranges.consumer_settings(bootstrap, {}, f"test-st{unique_name}")

        def fill_stage(stage_name: str, keep_raw: bool) -> int:
            consumer = kafka_ranges.worker_consumer(settings)
            return stage_ranges(staged.dsn(), TRICKY, staged.meta, stage_name, keep_raw, consumer,
                                kafka_ranges.offset_ranges({tp: kafka_ranges.EARLIEST for tp in ends}, ends))

        starts = {tp: kafka_ranges.EARLIEST for tp in ends}
        staged_result = staged.sink.process(0, starts, ends, fill_stage)
        batch = written.write(bootstrap, ends)
        assert len(batch.gids) == 2 and batch.rows == 3000
        parts_result = written.sink.process(0, starts, ends, fill_stage, staged=batch)
        assert staged_result.applied == parts_result.applied == 3000
        assert "commit_parts" in parts_result.timings_ms  # decided as parts, not fallen back to staging
        assert _rows(conn, staged_schema, "agg", "k") == _rows(conn, parts_schema, "agg", "k")
        assert _rows(conn, staged_schema, "ev", "2, 3") == _rows(conn, parts_schema, "ev", "2, 3")
        totals = {k: total for k, total, *_ in _rows(conn, parts_schema, "agg", "k")}
        assert max(totals.values()) > 2**63  # the sums did leave 64 bits
        assert any(last_s is None for *_, last_s, _flag in _rows(conn, parts_schema, "agg", "k"))
        assert not parts.prepared(conn, parts.pipeline_prefix(written.name))
    finally:
        staged.close()
        written.close()
        for schema in (staged_schema, parts_schema, staged.meta, written.meta):
            with conn.cursor() as cur:
                cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        conn.commit()
        conn.close()


def _ledger(stack: dict, tmp_path: Path, label: str) -> tuple[dict, _Pipeline, dict[tuple[str, int], int]]:
    """A ledger pipeline config, its 2,000 committed events in two partitions, its targets, and a sink."""
    config = pipeline_config(stack, tmp_path, f"{label}{uuid.uuid4().hex[:8]}")
    topic = config["topics"][0]
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=2)
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 2000, topic=topic, seed=8)
    conn = pg_connect(stack)
    preflight.create_targets(conn, LEDGER, config["target_schema"], MODES["exactly_once"])
    conn.close()
    pipeline = _Pipeline(stack, LEDGER, config["target_schema"], config["meta_schema"], config["pipeline"])
    ends = kafka_ranges_ends(stack["EOS_KAFKA_BOOTSTRAP"], topic)
    return config, pipeline, ends


def kafka_ranges_ends(bootstrap: str, topic: str) -> dict[tuple[str, int], int]:
    """Each partition's high watermark: the batch's end (its last transaction marker included)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "ends", "isolation.level": "read_committed"})
    try:
        return {(topic, p): consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in (0, 1)}
    finally:
        consumer.close()


def test_a_batch_decided_before_a_crash_is_committed_whole(stack: dict, tmp_path: Path) -> None:
    """P4: the decision committed, its parts still prepared. The audit calls the target wrong
    (offsets and balances without the events); the resolution a restart, a stop or a snapshot
    runs commits the decided parts and the audit calls it exact. Rolling them back instead, as a
    resolver that ignored the decision would, leaves it wrong for good."""
    config, pipeline, ends = _ledger(stack, tmp_path, "pfour")
    other_config, other, other_ends = _ledger(stack, tmp_path, "pfourneg")
    try:
        for p, e in ((pipeline, ends), (other, other_ends)):
            p.decide_only(p.write(stack["EOS_KAFKA_BOOTSTRAP"], e), e)
        wrong = audit(config, tmp_path)
        assert not wrong["ok"] and wrong["summary"]["missing"] == 2000, wrong["summary"]
        resolved = parts.resolve(pipeline.conn, pipeline.meta, pipeline.name)
        assert len(resolved["committed"]) == 2 and not resolved["rolled_back"]
        report = audit(config, tmp_path)
        assert report["ok"], report["summary"]
        # The negative control: the same state, its decided parts rolled back.
        parts.roll_back(other.conn, parts.pipeline_prefix(other.name))
        negative = audit(other_config, tmp_path)
        assert not negative["ok"] and negative["summary"]["missing"] == 2000, negative["summary"]
    finally:
        pipeline.close()
        other.close()


def test_undecided_parts_are_rolled_back_at_the_next_start(stack: dict, tmp_path: Path) -> None:
    """P1: parts prepared, no decision (a crash before it). The next driver rolls them back after
    its epoch bump and writes the batch again: exact. Committing them instead (what a
    restart does with a two_phase batch in doubt) would apply the batch twice."""
    config, pipeline, ends = _ledger(stack, tmp_path, "pone")
    other_config, other, other_ends = _ledger(stack, tmp_path, "poneneg")
    try:
        for p, e in ((pipeline, ends), (other, other_ends)):
            p.write(stack["EOS_KAFKA_BOOTSTRAP"], e)
        run = run_app(config, tmp_path, label="pone")
        assert run.process.returncode == 0, run.log()[-3000:]
        (resume,) = run.events("resume")
        assert len(resume["parts_rolled_back"]) == 2 and resume["write_path"] == "prepared_parts"
        report = audit(config, tmp_path)
        assert report["ok"], report["summary"]
        # The negative control: the undecided parts committed, then the same run.
        undecided = parts.prepared(other.conn, parts.pipeline_prefix(other.name))
        assert len(parts.commit(other.conn, other.meta, other.name, undecided)) == 2
        run = run_app(other_config, tmp_path, label="poneneg")
        assert run.process.returncode == 0, run.log()[-3000:]
        negative = audit(other_config, tmp_path)
        assert not negative["ok"] and negative["summary"]["duplicated"] == 2000, negative["summary"]
    finally:
        pipeline.close()
        other.close()


def test_a_record_the_database_refuses_sends_the_batch_to_staging(stack: dict, tmp_path: Path) -> None:
    """P2: an account id longer than the target's varchar(64) fails a task's COPY. The part is
    rolled back, the batch is written the staged way, and the record is quarantined with the
    database's verdict; everything else applies once."""
    config = pipeline_config(stack, tmp_path, f"ptwo{uuid.uuid4().hex[:8]}")
    topic = config["topics"][0]
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=2)
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 1000, topic=topic, seed=9)
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"]})
    producer.produce(topic, partition=1, value=(
        b'{"event_id": "poison", "account_id": "' + b"x" * 100 + b'", "amount_cents": 5,'
        b' "ts": "2026-01-01T00:00:00Z", "seq": 1}'))
    assert producer.flush(30) == 0
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 1000, topic=topic, seed=10)
    run = run_app(config, tmp_path, label="ptwo")
    assert run.process.returncode == 0, run.log()[-3000:]
    refused = run.events("parts_refused")
    assert refused and "22001" in " ".join(refused[0]["reasons"]), refused
    report = audit(config, tmp_path)
    assert report["ok"] and report["summary"]["dead_lettered"] == 1, report["summary"]
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT partition, sqlstate FROM {}.dead_letters WHERE pipeline = %s").format(
            sql.Identifier(config["meta_schema"])), (config["pipeline"],))
        assert cur.fetchall() == [(1, "22001")]
    conn.close()


def test_a_two_phase_restart_never_commits_parts(stack: dict, unique_name: str) -> None:
    """Parts carry their own id prefix: the restart of a two_phase pipeline of the same name
    commits its own batches in doubt, and never a part (which only a decision may commit)."""
    conn = pg_connect(stack)
    conn.autocommit = False
    name = f"pfix{unique_name}"
    gid = f"{parts.pipeline_prefix(name)}1:0:0:0"
    conn.tpc_begin(gid)
    with conn.cursor() as cur:
        cur.execute("SELECT 1")
    conn.tpc_prepare()
    conn.reset()
    try:
        assert resolve_in_doubt(conn, name) == []
        assert parts.prepared(conn, parts.pipeline_prefix(name)) == [gid]
    finally:
        parts.roll_back(conn, parts.pipeline_prefix(name))
        conn.close()


def test_parts_need_prepared_transactions(stack: dict) -> None:
    """Where PostgreSQL cannot prepare transactions the pipeline writes the staged way, and says so."""
    conn = pg_connect(stack)
    try:
        enabled, why = preflight.prepared_parts(conn, LEDGER, MODES["exactly_once"])
        assert enabled, why
        for mode in ("two_phase", "at_least_once", "idempotent"):
            assert not preflight.prepared_parts(conn, LEDGER, MODES[mode])[0]
    finally:
        conn.close()


def test_a_snapshot_never_holds_a_decision_without_its_rows(stack: dict, tmp_path: Path) -> None:
    """P4 and a snapshot: taken while a decided batch's parts are still prepared, it waits, then
    commits them (their driver is dead) and dumps the whole batch with its offsets. Without
    that wait it would hold offsets past rows it lacks, and a restore would resume after them."""
    import json
    import os

    from airflow_provider_eos.operators.snapshot import SnapshotOperator
    from airflow_provider_eos.recovery.store import SnapshotStore
    from tests.integration.test_snapshot_restore import PG_BIN, PG_CONN, connections_env

    os.environ.update(connections_env(stack))
    config, pipeline, ends = _ledger(stack, tmp_path, "psnap")
    try:
        pipeline.decide_only(pipeline.write(stack["EOS_KAFKA_BOOTSTRAP"], ends), ends)
        config_file = tmp_path / "psnap.json"
        config_file.write_text(json.dumps(config))
        summary = SnapshotOperator(task_id="snap", pipeline_config=str(config_file),
                                   snapshot_store=str(tmp_path / "store"), postgres_conn_id=PG_CONN, keep_last=1,
                                   pg_bin_dir=PG_BIN).execute({"run_id": "p4"})
        taken = SnapshotStore(tmp_path / "store").select(config["pipeline"], summary["snapshot_id"])
        events = next(t for t in taken.tables if t.qualified.endswith(".ledger_events"))
        assert events.rows == 2000, taken.tables
        assert taken.kafka_offsets and sum(taken.kafka_offsets[config["topics"][0]].values()) == sum(ends.values())
        assert taken.timings["decided_parts_wait"] >= 2.0, taken.timings
        assert not parts.prepared(pipeline.conn, parts.pipeline_prefix(pipeline.name))
    finally:
        pipeline.close()
