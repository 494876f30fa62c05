"""What stagers report (``records.spec.StageCount``): a Spark batch's tasks' reports merged on
the driver, a row pipeline's bare counts taken as they are."""

from __future__ import annotations

from spark_apps.eos_stream.cdc.transaction_walk import Group, Groups
from spark_apps.eos_stream.records.spec import StageCount


def groups(*names: str) -> Groups:
    return Groups.of(Group(name, 0, "change", name, None, 1, 0, 0) for name in names)


def test_reports_of_a_whole_mirrors_tasks_merge_their_rows_and_groups_in_task_order() -> None:
    merged = StageCount.merged([StageCount(3, groups("a")), StageCount(0, groups()), StageCount(2, groups("b", "c"))])
    assert merged == StageCount(5, groups("a", "b", "c"))


def test_a_task_without_groups_leaves_the_batch_without_groups_and_an_unknown_count_unknown() -> None:
    assert StageCount.merged([StageCount(3, groups("a")), StageCount(2)]) == StageCount(5, None)
    assert StageCount.merged([StageCount(3), None]).rows is None
    assert StageCount.merged([]) == StageCount(0, groups())


def test_a_bare_count_is_a_report_without_groups() -> None:
    assert StageCount.of(7) == StageCount(7, None)
    assert StageCount.of(None) == StageCount(None, None)
    report = StageCount(4, groups())
    assert StageCount.of(report) is report
