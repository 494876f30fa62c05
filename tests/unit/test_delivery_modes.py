"""Delivery modes and two-phase transaction ids (pure logic)."""

from __future__ import annotations

import pytest

from spark_apps.eos_stream.sink.in_doubt import GID_LIMIT, gid_prefix, transaction_id
from spark_apps.eos_stream.sink.modes import MODES


def test_only_two_phase_splits_the_commit() -> None:
    assert [m for m in MODES.values() if m.two_phase] == [MODES["two_phase"]]
    # two_phase keeps every guard of exactly_once: it only splits the commit.
    eos, tpc = MODES["exactly_once"], MODES["two_phase"]
    assert (tpc.stores_offsets, tpc.dedupe, tpc.upsert_rows, tpc.allows_aggregates) == (
        eos.stores_offsets, eos.dedupe, eos.upsert_rows, eos.allows_aggregates)


def test_transaction_id_is_deterministic_per_batch_and_findable_by_prefix() -> None:
    start = {("ledger.events", 0): 100, ("ledger.events", 1): 250}
    same = {("ledger.events", 1): 250, ("ledger.events", 0): 100}  # order does not matter
    gid = transaction_id("ledger", start)
    assert gid == transaction_id("ledger", same)
    assert gid.startswith(gid_prefix("ledger")) and len(gid) <= GID_LIMIT
    assert transaction_id("ledger", {**start, ("ledger.events", 1): 251}) != gid  # the next batch
    assert not transaction_id("ledger2", start).startswith(gid_prefix("ledger"))  # other pipelines


def test_transaction_id_refuses_a_name_postgres_cannot_hold() -> None:
    with pytest.raises(ValueError, match="too long"):
        transaction_id("p" * 190, {("t", 0): 1})
