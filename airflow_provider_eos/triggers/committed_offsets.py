"""The asset watcher's trigger: an Asset event each time a pipeline's committed offsets move.

It polls the pipeline's offsets table (written in the same transaction as each batch's data)
and fires ``{"pipeline", "offsets", "batch_ids", "batch_id", "change"}`` whenever the position
differs from the last one it announced. Airflow attaches the payload to an Asset event on every
target table of the pipeline (``extra["payload"]``), so a DAG scheduled on a target runs with
"the target now holds everything Kafka committed below these offsets".

Delivery of the events: the last position announced is kept in Airflow's asset state store
(when this Airflow has one), so a restarted triggerer announces what moved while it was down
and does not announce the same position twice. A triggerer killed between handing an event to
Airflow and recording it may announce that position once more; one lost before Airflow stored
it is covered by the next, since each event carries the whole position, not a difference.
Positions between two polls are not announced one by one: an event means "at least up to here".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from airflow_provider_eos.utils.committed_position import Offsets, committed_position, position_change
from spark_apps.eos_stream.state.meta_tables import DEFAULT_SCHEMA

STATE_KEY = "eos_committed_offsets"


class CommittedOffsetsTrigger(BaseEventTrigger):
    """
    Fires whenever the pipeline's committed offsets differ from the last position it announced.

    Meant for an ``AssetWatcher`` on the pipeline's target assets (see
    :func:`airflow_provider_eos.dag_factory.assets.pipeline_assets`), not for a deferred task.

    :param pipeline: pipeline name.
    :param postgres_conn_id: the target database's connection.
    :param meta_schema: schema of the bookkeeping tables.
    :param asset_names: the watched assets' names, where the last announced position is kept.
    :param poke_interval: seconds between reads of the offsets table.
    """

    def __init__(self, pipeline: str, postgres_conn_id: str = "eos_postgres", meta_schema: str = DEFAULT_SCHEMA,
                 asset_names: Sequence[str] = (), poke_interval: float = 5.0) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.postgres_conn_id = postgres_conn_id
        self.meta_schema = meta_schema
        self.asset_names = list(asset_names)
        self.poke_interval = float(poke_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "pipeline": self.pipeline, "postgres_conn_id": self.postgres_conn_id,
            "meta_schema": self.meta_schema, "asset_names": list(self.asset_names),
            "poke_interval": self.poke_interval,
        })

    def read_position(self) -> dict[str, Any] | None:
        from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
        from airflow_provider_eos.state.offsets import committed_offsets

        hook = EosPostgresHook(postgres_conn_id=self.postgres_conn_id, meta_schema=self.meta_schema)
        return committed_position(self.pipeline, committed_offsets(hook, self.pipeline))

    def _accessors(self) -> list[Any]:
        """The state store of every watched asset this trigger names (none on an Airflow without one)."""
        store = getattr(self, "asset_state_store", None)
        if store is None:
            return []
        from airflow.sdk import Asset

        found = []
        for name in self.asset_names:
            try:
                found.append(store[Asset.ref(name=name)])
            except KeyError:  # an asset no active DAG schedules on is not watched
                continue
        return found

    async def _last_announced(self) -> Offsets | None:
        for accessor in self._accessors():
            try:
                value = await accessor.aget(STATE_KEY)
            except Exception as err:
                self.log.warning("eos: cannot read the last announced position of %s: %s", self.pipeline, err)
                continue
            if isinstance(value, dict):
                return value
        return None

    async def _remember(self, offsets: Offsets) -> None:
        for accessor in self._accessors():
            try:
                await accessor.aset(STATE_KEY, offsets)
            except Exception as err:
                self.log.warning("eos: cannot record the announced position of %s: %s", self.pipeline, err)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        announced = await self._last_announced()
        while True:
            try:
                position = await asyncio.to_thread(self.read_position)
            except Exception as err:
                # The database being away is not an event: try again at the next poll.
                self.log.warning("eos: cannot read %s's committed offsets: %s", self.pipeline, err)
                position = None
            if position is not None:
                change = position_change(announced, position["offsets"])
                if change is not None:
                    self.log.info("eos: %s's committed offsets %s: batch %s", self.pipeline, change,
                                  position["batch_id"])
                    yield TriggerEvent({**position, "change": change})
                    announced = position["offsets"]
                    await self._remember(announced)
            await asyncio.sleep(self.poke_interval)
