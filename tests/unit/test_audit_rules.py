"""The audit's pure rules: dead-letter verdicts, ranges against Kafka's earliest
offset and the stored offsets, row comparison, aggregate carriers, and the
read progress that must never wait for a record that cannot come."""

from __future__ import annotations

from collections import Counter

import pytest
from psycopg2 import sql

from spark_apps.eos_stream.audit.rules import (
    APPLIES,
    REFUSED,
    UNPARSABLE,
    AuditTimeout,
    PartitionRange,
    ReadProgress,
    as_number,
    carrier_for,
    compare_rows,
    dead_letter_verdict,
    goal_shortfall,
    keep_latest,
    retired_topics,
    tail_counts_as_missing,
    wrong_keys,
)
from spark_apps.eos_stream.errors import dead_letter_class
from spark_apps.eos_stream.kafka.offsets import from_nested
from spark_apps.eos_stream.records.spec import AggregateTarget, Field, PipelineSpec, RowTarget, SpecError
from spark_apps.eos_stream.run.preflight import is_compacted
from spark_apps.ledger.spec import LEDGER, LEDGER_EVENTS_ONLY


@pytest.mark.parametrize(
    ("sqlstate", "trial", "wrong"),
    [
        ("55P03", None, "SQLSTATE 55P03 is not a data error"),  # lock timeout: the weather
        ("57014", None, "SQLSTATE 57014 is not a data error"),  # statement timeout
        ("40P01", None, "SQLSTATE 40P01 is not a data error"),  # deadlock
        ("42P01", None, "SQLSTATE 42P01 is not a data error"),  # a missing table is not the record's fault
        (None, APPLIES, "its own insert into the targets succeeds"),  # "parse error" on a record that applies
        ("22001", APPLIES, "a valid record quarantined"),  # the database takes it now
        ("23503", None, "SQLSTATE 23503 is not a data error"),  # a missing parent row blocks, never poisons
        (None, UNPARSABLE, None),  # the app's own parse error, or a tombstone
        ("22001", REFUSED + "22001", None),  # value too long: the database still refuses it
        ("23505", REFUSED + "23505", None),  # integrity
        ("22007", REFUSED + "22P02", None),  # refused, if for another reason now
    ],
)
def test_dead_letter_verdicts(sqlstate: str | None, trial: str | None, wrong: str | None) -> None:
    verdict = dead_letter_verdict(dead_letter_class(sqlstate, "rejected"), trial)
    if wrong is None:
        assert verdict is None
    else:
        assert verdict is not None and wrong in verdict


def test_goal_offsets_and_shortfall() -> None:
    # As XCom's JSON gives a replay's lso_at_start: partition keys are strings.
    goal = from_nested({"t": {"0": 10, "1": 5}, "u": {"0": 0}})
    assert goal == {("t", 0): 10, ("t", 1): 5, ("u", 0): 0}
    assert from_nested(None) == {}
    # Stored at or past the goal is reached (a live topic moves on); below it, or nothing stored, is short.
    assert goal_shortfall({("t", 0): 12, ("t", 1): 3}, goal) == {("t", 1): 2}
    assert goal_shortfall({}, goal) == {("t", 0): 10, ("t", 1): 5}


@pytest.mark.parametrize(("policy", "compacted"), [
    ("delete", False), ("compact", True), ("compact,delete", True), ("delete, compact", True),
    ("COMPACT", True), (None, False), ("", False),
])
def test_a_compacted_topic_is_told_by_its_cleanup_policy(policy: str | None, compacted: bool) -> None:
    assert is_compacted(policy) is compacted


def test_retired_topics_are_those_no_longer_in_the_definition() -> None:
    seen = [("ledger", 0), ("old", 0), ("old", 3), ("ledger", 1)]
    assert retired_topics(["ledger"], seen) == {("old", 0), ("old", 3)}
    assert retired_topics(["ledger", "old"], seen) == set()


def test_range_compares_up_to_the_stored_offset_and_flags_gaps() -> None:
    running = PartitionRange(earliest=100, lso=500, stored=400, stores_offsets=True)
    assert running.applied_end == 400
    assert running.check_end(tail_missing=False) == 400
    assert running.check_end(tail_missing=True) == 500
    assert running.retention_gap == 0 and running.offsets_ahead == 0
    gap = PartitionRange(earliest=100, lso=500, stored=40, stores_offsets=True)
    assert gap.retention_gap == 60
    assert gap.check_end(tail_missing=False) == 100  # nothing below the earliest offset to compare
    ahead = PartitionRange(earliest=0, lso=500, stored=700, stores_offsets=True)
    assert ahead.offsets_ahead == 200 and ahead.applied_end == 500
    never = PartitionRange(earliest=0, lso=500, stored=None, stores_offsets=True)
    assert never.applied_end == 0 and never.retention_gap == 0
    no_offsets = PartitionRange(earliest=0, lso=500, stored=None, stores_offsets=False)
    assert no_offsets.applied_end == 500 and no_offsets.check_end(tail_missing=False) == 500


def test_pending_policy() -> None:
    assert tail_counts_as_missing("auto", running=False) is True
    assert tail_counts_as_missing("auto", running=True) is False
    assert tail_counts_as_missing("missing", running=True) is True
    assert tail_counts_as_missing("allowed", running=False) is False
    # After a replay the goal is checked on its own: the tail is the resumed stream's work.
    assert tail_counts_as_missing("auto", running=False, has_goal=True) is False
    assert tail_counts_as_missing("missing", running=False, has_goal=True) is True
    with pytest.raises(ValueError, match="pending must be one of"):
        tail_counts_as_missing("sometimes", running=False)


def test_rows_below_the_earliest_offset_are_not_unexpected() -> None:
    rng = PartitionRange(earliest=10, lso=20, stored=20, stores_offsets=True)
    present = Counter({o: 1 for o in range(0, 20)})
    result = compare_rows(set(range(10, 20)), present, rng, tail_missing=True)
    assert (result.unexpected, result.missing, result.duplicated) == (0, 0, 0)
    assert result.rows_below_earliest == 10 and result.rows == 20


def test_row_comparison_counts_each_kind_of_wrong() -> None:
    rng = PartitionRange(earliest=10, lso=30, stored=20, stores_offsets=True)
    present = Counter({5: 2, 11: 1, 12: 1, 25: 1})  # dup below earliest, 13-19 missing, 25 beyond the offsets
    result = compare_rows(set(range(10, 20)), present, rng, tail_missing=False)
    assert result.duplicated == 1
    assert result.missing == 8  # 10 and 13..19
    assert result.unexpected == 1  # 25: not a record the target should hold
    assert result.beyond_offsets == 1
    assert result.rows_below_earliest == 2


def test_no_stored_offsets_with_rows_is_beyond_offsets() -> None:
    rng = PartitionRange(earliest=0, lso=5, stored=None, stores_offsets=True)
    assert compare_rows(set(), Counter({0: 1}), rng, tail_missing=False).beyond_offsets == 1
    loose = PartitionRange(earliest=0, lso=5, stored=None, stores_offsets=False)
    assert compare_rows({0}, Counter({0: 1}), loose, tail_missing=False).beyond_offsets == 0


def test_carrier_is_the_row_target_holding_the_aggregate_inputs() -> None:
    balances = next(t for t in LEDGER.targets if isinstance(t, AggregateTarget))
    assert carrier_for(LEDGER, balances) == LEDGER.targets[0]
    narrow = PipelineSpec(
        name="narrow",
        fields=(Field("account_id", "text"), Field("amount_cents", "bigint")),
        targets=(RowTarget("ids", columns=("account_id",)),
                 AggregateTarget("sums", group_by=("account_id",), increments={"total": "amount_cents"})),
    )
    assert carrier_for(narrow, narrow.targets[1]) is None  # amount_cents is in no row target
    assert not any(isinstance(t, AggregateTarget) for t in LEDGER_EVENTS_ONLY.targets)


def test_wrong_keys_treats_absent_as_zero_and_decimals_as_numbers() -> None:
    from decimal import Decimal

    actual = {("a",): {"n": Decimal(3)}, ("b",): {"n": 0}}
    assert wrong_keys(actual, {("a",): Counter(n=3)}, ["n"]) == []
    assert wrong_keys(actual, {("a",): Counter(n=2), ("c",): Counter(n=1)}, ["n"]) == [("a",), ("c",)]
    assert as_number(Decimal("2.5")) == 2.5 and as_number(None) == 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_read_progress_finishes_by_offset_not_by_records() -> None:
    a, b, c, d = ("t", 0), ("t", 1), ("t", 2), ("t", 3)
    progress = ReadProgress(ends={a: 11, b: 11, c: 5, d: 0}, starts={a: 0, b: 11, c: 2, d: 0},
                            deadline=10.0, clock=Clock())
    assert progress.pending == {a, c}  # b: all deleted (earliest == end); d: empty
    assert progress.record(a, 9) is True  # the last record; a commit marker follows at 10
    assert a in progress.pending
    progress.position(a, -1001)  # not known yet: nothing changes
    assert a in progress.pending
    progress.position(a, 11)  # the client moved past the marker
    assert a not in progress.pending
    progress.end_of_partition(c, 5)
    assert progress.done
    assert progress.record(a, 12) is False  # a prefetched record past the end is not yielded


def test_read_progress_times_out_naming_the_partitions() -> None:
    clock = Clock()
    a, b = ("orders", 0), ("orders", 1)
    progress = ReadProgress(ends={a: 100, b: 50}, starts={a: 0, b: 0}, deadline=30.0, clock=clock)
    progress.record(b, 49)
    progress.check_deadline(30)  # before the deadline: nothing
    clock.now = 30.0
    with pytest.raises(AuditTimeout) as caught:
        progress.check_deadline(30)
    message = str(caught.value)
    assert message.startswith("audit timed out after 30s reading Kafka; 1 partition(s) did not finish: "
                              "orders[0] at offset 0 of 100")
    assert caught.value.unfinished == [{"topic": "orders", "partition": 0, "position": 0, "end": 100, "left": 100}]


# --- the report, from a synthetic snapshot and Kafka side (no I/O) ----------------


def _side(aggregates: int, applied: dict[int, dict], tail: dict[int, dict], tp=("t", 0)):
    """A KafkaSide from {offset: record} per region (None: malformed)."""
    from spark_apps.eos_stream.audit.kafka import KafkaSide

    side = KafkaSide(aggregates)
    for region, records in enumerate((applied, tail)):
        for offset, record in records.items():
            side.committed[region][tp] += 1
            if record is None:
                side.malformed[region][tp].add(offset)
                continue
            side.valid[region][tp].add(offset)
            if aggregates:
                side.sums[region][0][(record["account_id"],)]["total"] += record["amount_cents"]
    return side


NARROW = PipelineSpec(
    name="narrow",
    fields=(Field("account_id", "text"), Field("amount_cents", "bigint")),
    targets=(RowTarget("ids", columns=("account_id",)),
             AggregateTarget("sums", group_by=("account_id",), increments={"total": "amount_cents"})),
)


def _narrow_report(*, earliest: int, running: bool, rows: dict[int, int], totals: int,
                   goal: dict | None = None, retired: dict[int, int] | None = None):
    """Partition t[0]: offsets 0-9 committed, 8 stored. ``retired``: rows of a topic "old" no longer
    in the definition (offset: count), with a stored offset 3 and one dead letter."""
    from spark_apps.eos_stream.audit.report import build_report
    from spark_apps.eos_stream.audit.snapshot import Snapshot
    from spark_apps.eos_stream.run.config import PipelineConfig

    applied = {o: {"account_id": "a", "amount_cents": 10} for o in range(earliest, 8)}
    tail = {o: {"account_id": "a", "amount_cents": 10} for o in range(8, 10)}
    stored, present, dead = {("t", 0): 8}, {("t", 0): Counter(rows)}, {}
    if retired is not None:
        stored[("old", 0)], present[("old", 0)] = 3, Counter(retired)
        dead[("old", 0, 2)] = ("malformed JSON", None, None, b"{")
    snap = Snapshot(running=running, stored=stored, dead=dead, rows={"ids": present},
                    actual=[{("a",): {"total": totals}}], below_earliest=[None],
                    below_latest=[{}], retired={tp for tp in stored if tp[0] == "old"})
    ranges = {("t", 0): PartitionRange(earliest, 10, 8, True)}
    return build_report(PipelineConfig(pipeline="p", topics=["t"], spec="m:S"), NARROW, [NARROW.targets[1]], snap,
                        ranges, _side(1, applied, tail), {}, running=running, pending="auto", goal=goal)


def test_report_counts_the_tail_as_not_yet_applied_while_a_driver_runs() -> None:
    report = _narrow_report(earliest=0, running=True, rows={o: 1 for o in range(8)}, totals=80)
    assert report["ok"], report
    assert report["summary"]["not_yet_applied"] == 2 and report["summary"]["committed_records"] == 8
    stopped = _narrow_report(earliest=0, running=False, rows={o: 1 for o in range(8)}, totals=80)
    assert not stopped["ok"] and stopped["summary"]["missing"] == 2
    assert stopped["mismatches"] == ["ids:t:0", "sums"]


def test_report_after_a_replay_compares_up_to_the_stored_offsets_and_checks_the_goal() -> None:
    # No driver runs (the recovery's audit), yet the tail is the resumed stream's work: not missing.
    reached = _narrow_report(earliest=0, running=False, rows={o: 1 for o in range(8)}, totals=80,
                             goal={("t", 0): 8})
    assert reached["ok"], reached
    assert reached["summary"]["not_yet_applied"] == 2 and reached["summary"]["missing"] == 0
    assert reached["goal"] == {"t:0": {"goal": 8, "stored_offset": 8, "short": 0}}
    # Stored offsets short of the goal: the replay did not do its work, whatever the rows say.
    short = _narrow_report(earliest=0, running=False, rows={o: 1 for o in range(8)}, totals=80,
                           goal={("t", 0): 9})
    assert short["mismatches"] == ["goal_not_reached:t:0"] and short["summary"]["goal_shortfall"] == 1
    # Below the stored offsets it is as strict as ever.
    missing = _narrow_report(earliest=0, running=False, rows={o: 1 for o in range(7)}, totals=80,
                             goal={("t", 0): 8})
    assert missing["mismatches"] == ["ids:t:0"] and missing["summary"]["missing"] == 1


def test_report_sets_a_retired_topic_aside() -> None:
    report = _narrow_report(earliest=0, running=True, rows={o: 1 for o in range(8)}, totals=80,
                            retired={0: 1, 1: 1, 1_000: 1})
    # Its rows are neither unexpected nor beyond offsets, its dead letter is not "not in Kafka".
    assert report["ok"], report
    assert report["retired_topics"] == {"old": {"stored_offsets": {"0": 3}, "rows": {"ids": 3}, "dead_letters": 1}}
    assert report["summary"]["retired_topics"] == 1 and report["summary"]["dead_lettered"] == 0
    assert "ids:old:0" not in report["partitions"]
    # Its records are in the aggregates and Kafka is not read for them: without a carrier, unverified.
    (entry,) = report["unverified"]
    assert "old[0] (retired)" in entry["reason"]


def test_report_leaves_an_aggregate_without_carrier_unverified_once_kafka_deleted_inputs() -> None:
    report = _narrow_report(earliest=3, running=True, rows={o: 1 for o in range(8)}, totals=80)
    assert report["ok"], report  # rows 0-2 are below the earliest offset: not unexpected
    assert report["summary"]["rows_below_earliest"] == 3
    sums = report["aggregates"]["sums"]
    assert sums["verified"] is False and sums["keys_wrong"] is None
    (entry,) = report["unverified"]
    assert entry["target"] == "sums" and "no row target carries the inputs of sums" in entry["reason"]
    whole = _narrow_report(earliest=0, running=True, rows={o: 1 for o in range(8)}, totals=70)
    assert not whole["ok"] and whole["aggregates"]["sums"]["keys_wrong"] == 1  # all inputs in Kafka: checked


def test_report_judges_a_dead_letter_by_its_trial() -> None:
    from spark_apps.eos_stream.audit.report import build_report
    from spark_apps.eos_stream.audit.snapshot import Snapshot
    from spark_apps.eos_stream.run.config import PipelineConfig

    config = PipelineConfig(pipeline="p", topics=["t"], spec="m:S")
    ranges = {("t", 0): PartitionRange(5, 10, 10, True)}  # offset 0 is gone from Kafka
    rows = {"ids": {("t", 0): Counter({o: 1 for o in range(1, 10)})}}

    def report(sqlstate: str | None, trial: str | None):
        snap = Snapshot(running=False, stored={("t", 0): 10},
                        dead={("t", 0, 0): ("whatever", sqlstate, None, b"{}")},
                        rows=rows, actual=[], below_earliest=[], below_latest=[])
        spec = PipelineSpec(name="rows", fields=NARROW.fields, targets=(NARROW.targets[0],))
        side = _side(0, {o: {} for o in range(5, 10)}, {})
        trials = {} if trial is None else {("t", 0, 0): trial}
        return build_report(config, spec, [], snap, ranges, side, trials, running=False, pending="auto")

    assert report(None, UNPARSABLE)["ok"]
    wrong = report(None, APPLIES)
    assert wrong["mismatches"] == ["dead_letters:wrongly_quarantined"]
    assert wrong["dead_letters"]["wrongly_quarantined"][0]["trial"] == APPLIES
    assert report("23505", REFUSED + "23505")["ok"]
    assert report("23503", APPLIES)["mismatches"] == ["dead_letters:wrongly_quarantined"]
    assert report("57014", None)["summary"]["dead_letters_by_class"] == {"not_data:57014": 1}


def test_keep_latest_is_the_in_order_fold_whatever_the_reading_order() -> None:
    import itertools

    events = [((0, 3), 30), ((0, 7), 70), ((0, 5), 50), ((1, 0), 1)]
    for order in itertools.permutations(events):
        latest: dict = {}
        for position, value in order:
            keep_latest(latest, "last", position, value)
        assert latest == {"last": ((1, 0), 1)}
    one_partition: dict = {}
    for position, value in reversed(events[:3]):
        keep_latest(one_partition, "last", position, value)
    assert one_partition["last"][1] == 70


def test_a_latest_column_is_set_from_the_last_record_not_added() -> None:
    from spark_apps.eos_stream.sink.apply_sql import apply_batch_statement

    balances = next(t for t in LEDGER.targets if isinstance(t, AggregateTarget))
    assert balances.columns == ["balance_cents", "event_count", "last_seq"]
    assert balances.inputs == {"account_id", "amount_cents", "seq"}
    statement = repr(apply_batch_statement(LEDGER, stage=sql.Identifier("stage"), target_schema="t", meta_schema="m",
                                           skip_applied=True, dedupe=True, upsert_rows=False))
    # last_seq is a bigint: the highest (partition, offset)'s value by a hashable max
    # (tests/integration/test_latest_values.py)
    assert ("SQL('(max(ARRAY['), Identifier('_partition'), SQL('::bigint, '), Identifier('_offset'), SQL(', '),"
            " Identifier('seq'), SQL('::bigint]))[3]')") in statement
    assert "Identifier('last_seq'), SQL(' = EXCLUDED.')" in statement.replace('"', "'")


def test_a_column_cannot_be_both_an_increment_and_a_latest_value() -> None:
    with pytest.raises(SpecError, match="either an increment or a latest value"):
        PipelineSpec(name="x", fields=(Field("k", "text"), Field("v", "bigint")),
                     targets=(AggregateTarget("a", group_by=("k",), increments={"v": "v"}, latest={"v": "v"}),))
    with pytest.raises(SpecError, match="unknown fields"):
        PipelineSpec(name="x", fields=(Field("k", "text"),),
                     targets=(AggregateTarget("a", group_by=("k",), increments={}, latest={"last": "nope"}),))


def test_a_retired_topics_rows_come_before_every_current_record_in_the_latest_order() -> None:
    from spark_apps.eos_stream.audit.snapshot import latest_position

    retired = {("old", 0), ("old", 1)}
    latest: dict = {}
    keep_latest(latest, "last", latest_position("old", 1, 9_000, retired), "old value")
    keep_latest(latest, "last", latest_position("new", 0, 3, retired), "new value")
    keep_latest(latest, "last", latest_position("old", 0, 50_000, retired), "older still")
    assert latest["last"][1] == "new value"
    # Within the retired topic its own order holds.
    assert latest_position("old", 0, 5, retired) < latest_position("old", 0, 6, retired)


def test_wrong_keys_means_what_sql_means() -> None:
    """A NULL increment is wrong even where 0 is expected (NULL + x stays NULL in SQL); numeric
    totals compare digit for digit, not through a float; a latest NULL is not a latest 0."""
    from decimal import Decimal

    assert wrong_keys({("a",): {"n": None}}, {("a",): Counter()}, ["n"]) == [("a",)]
    tenth = sum([Decimal("0.1")] * 10, Decimal(0))
    assert wrong_keys({("a",): {"s": Decimal("1.0")}}, {("a",): Counter(s=tenth)}, ["s"]) == []
    assert wrong_keys({("a",): {"s": Decimal("1.000000001")}}, {("a",): Counter(s=tenth)}, ["s"]) == [("a",)]
    assert as_number(Decimal("0.1")) == Decimal("0.1") and as_number(Decimal("0.1")) != 0.1
    assert wrong_keys({("a",): {"last": None}}, {("a",): Counter()}, [], {("a",): {"last": 0}}, ["last"]) == [("a",)]
    assert wrong_keys({("a",): {"last": None}}, {("a",): Counter()}, [], {("a",): {"last": None}}, ["last"]) == []
