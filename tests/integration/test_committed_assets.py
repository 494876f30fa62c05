"""The committed-offsets watcher against the real stack: after each availableNow run of the real
app its trigger announces exactly the offsets the run committed (the LSO of every partition) with
the batch ids, stays quiet while nothing moves, and calls a position that went back "rewound"."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from typing import Any

import pytest
from psycopg2 import sql

from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
from airflow_provider_eos.state.offsets import committed_offsets
from airflow_provider_eos.triggers.committed_offsets import CommittedOffsetsTrigger
from spark_apps.eos_stream.state import meta_tables
from tests.integration.test_stream_operator import airflow_conns, make_pipeline  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


class Watch:
    """The trigger run as the triggerer runs it: one async generator, iterated in its own event
    loop (a thread here), each event's payload queued for the test."""

    def __init__(self, trigger: CommittedOffsetsTrigger) -> None:
        self.payloads: queue.Queue[dict[str, Any]] = queue.Queue()
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Task | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._pump(trigger),),
                                       daemon=True)
        self.thread.start()

    async def _pump(self, trigger: CommittedOffsetsTrigger) -> None:
        self.task = asyncio.current_task()
        with contextlib.suppress(asyncio.CancelledError):
            async for event in trigger.run():
                self.payloads.put(event.payload)

    def next(self, timeout: float) -> dict[str, Any] | None:
        """The next event's payload, or None if none came within ``timeout`` seconds."""
        try:
            return self.payloads.get(timeout=timeout)
        except queue.Empty:
            return None

    def until(self, offsets: dict[str, dict[str, int]], timeout: float) -> list[dict[str, Any]]:
        """Every event up to the first that announces ``offsets``: the watcher polls while the
        app commits batch after batch, so it may announce positions on the way."""
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while not seen or seen[-1]["offsets"] != offsets:
            payload = self.next(max(0.1, deadline - time.monotonic()))
            assert payload is not None, f"no event announced {offsets}; saw {seen}"
            seen.append(payload)
        return seen

    def close(self) -> None:
        if self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)


def _lso(topic: str) -> dict[str, dict[str, int]]:
    offsets = KafkaOffsetsHook().partition_offsets([topic])
    return {topic: {str(p): int(o.last_stable) for (_, p), o in sorted(offsets.items())}}


def _assert_moving_forward(events: list[dict[str, Any]]) -> None:
    for before, after in itertools.pairwise(events):
        for topic, parts in before["offsets"].items():
            assert all(after["offsets"][topic][p] >= o for p, o in parts.items()), (before, after)
        # Batch ids are Spark's, per checkpoint: a new run may count from 0 again; offsets never go back.
        assert after["offsets"] != before["offsets"]


def test_each_commit_is_announced_with_its_offsets(make_pipeline) -> None:  # noqa: F811 - imported fixture
    p = make_pipeline("assets", partitions=3)
    trigger = CommittedOffsetsTrigger(pipeline=p.name, meta_schema=p.config["meta_schema"], poke_interval=0.5)
    # Round trip through its JSON kwargs, as the triggerer builds it.
    trigger = CommittedOffsetsTrigger(**trigger.serialize()[1])
    watch = Watch(trigger)
    try:
        assert watch.next(3) is None  # nothing committed yet: nothing to announce

        p.produce(900)
        p.operator(trigger="availableNow", max_offsets_per_trigger=400).execute({})
        events = watch.until(_lso(p.topic), 30)  # every committed record is below the last one's offsets
        assert [e["change"] for e in events] == ["first"] + ["advanced"] * (len(events) - 1)
        _assert_moving_forward(events)
        first = events[-1]
        assert first["pipeline"] == p.name
        stored = committed_offsets(p.pg(), p.name)
        assert first["batch_ids"] == {p.topic: {str(r["partition"]): r["batch_id"] for r in stored}}
        assert first["batch_id"] == max(r["batch_id"] for r in stored) >= 2  # 900 records, 400 per batch

        watch.close()
        watch = Watch(CommittedOffsetsTrigger(**trigger.serialize()[1]))  # a fresh trigger, no state store
        restarted = watch.next(10)
        assert restarted is not None and restarted["offsets"] == first["offsets"]  # said again, never lost

        p.produce(300)
        p.operator(trigger="availableNow", max_offsets_per_trigger=400).execute({})
        events = watch.until(_lso(p.topic), 30)
        assert {e["change"] for e in events} == {"advanced"}
        _assert_moving_forward([first, *events])
        assert watch.next(2) is None  # nothing moved since

        # What a restore leaves: the stored offsets of an earlier snapshot (written here by hand).
        hook = p.pg()
        with hook.cursor() as cur:
            cur.execute(sql.SQL("UPDATE {} SET next_offset = %s WHERE pipeline = %s AND partition = 0")
                        .format(meta_tables.table(p.config["meta_schema"], meta_tables.OFFSETS)),
                        (first["offsets"][p.topic]["0"], p.name))
        rewound = watch.next(30)
        assert rewound is not None and rewound["change"] == "rewound"
    finally:
        watch.close()
