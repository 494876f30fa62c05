"""Triggers on a pipeline's progress rows (liveness) and on its stored offsets vs the LSO (caught up).

Both run their blocking DB and Kafka calls in a worker thread and fire one event:
``{"status": "ok" | "timeout" | "error", "message": ..., "report": {...}}``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple

from airflow.triggers.base import BaseTrigger, TriggerEvent

from spark_apps.eos_stream.kafka.offsets import from_nested
from spark_apps.eos_stream.state.meta_tables import DEFAULT_SCHEMA


# ---------------------------------------------------------------------- pure checks
def liveness_report(progress: dict[str, Any] | None, max_age_seconds: float) -> dict[str, Any]:
    """Whether the newest progress row is younger than ``max_age_seconds``."""
    if progress is None:
        return {"ok": False, "age_seconds": None, "last_progress": None,
                "message": "no progress row: the pipeline has never finished a batch"}
    age = float(progress["age_seconds"])
    ok = age <= max_age_seconds
    message = (f"last batch {progress['batch_id']} of run {progress['run_id']} recorded {age:.0f}s ago "
               f"({progress['input_rows']} rows); limit {max_age_seconds:g}s")
    return {"ok": ok, "age_seconds": round(age, 1), "last_progress": _jsonable(progress), "message": message}


def lag_report(stored: dict[tuple[str, int], int], offsets: dict[tuple[str, int], Any], max_lag: int
               ) -> dict[str, Any]:
    """Per-partition lag = last stable offset - stored next offset (from the retention start if
    the pipeline never stored one). ``ok`` when every partition's lag is <= ``max_lag``."""
    partitions: list[dict[str, Any]] = []
    for (topic, partition), off in sorted(offsets.items()):
        lso = int(off.last_stable)
        base = stored.get((topic, partition))
        from_start = base is None
        if base is None:
            base = int(off.earliest) if off.earliest is not None else 0
        partitions.append({"topic": topic, "partition": partition, "last_stable": lso, "stored": base,
                           "never_stored": from_start, "lag": max(0, lso - base)})
    behind = [p for p in partitions if p["lag"] > max_lag]
    total = sum(p["lag"] for p in partitions)
    if behind:
        worst = ", ".join(f"{p['topic']}[{p['partition']}] lag {p['lag']}" for p in behind[:10])
        message = f"{len(behind)} of {len(partitions)} partitions behind (total lag {total}): {worst}"
    else:
        message = f"caught up: {len(partitions)} partitions, total lag {total} (max per partition {max_lag})"
    return {"ok": not behind, "total_lag": total, "partitions": partitions, "message": message}


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v))
            for k, v in row.items()}


# ---------------------------------------------------------------------- triggers
class PollingTrigger(BaseTrigger):
    """Calls ``self.check()`` in a thread every ``poke_interval`` until it is ok or
    ``timeout_seconds`` (0: never) have passed."""

    poke_interval: float
    timeout_seconds: float

    def check(self) -> dict[str, Any]:
        raise NotImplementedError

    async def run(self) -> AsyncIterator[TriggerEvent]:
        deadline = time.monotonic() + self.timeout_seconds if self.timeout_seconds > 0 else None
        report: dict[str, Any] | None = None
        while True:
            started = time.monotonic()
            try:
                report = await asyncio.to_thread(self.check)
            except Exception as err:
                yield TriggerEvent({"status": "error", "message": f"{type(err).__name__}: {err}", "report": report})
                return
            if report["ok"]:
                yield TriggerEvent({"status": "ok", "message": report["message"], "report": report})
                return
            self.log.info("%s", report["message"])
            if deadline is not None and time.monotonic() + self.poke_interval > deadline:
                yield TriggerEvent({"status": "timeout", "message": report["message"], "report": report})
                return
            await asyncio.sleep(max(0.0, self.poke_interval - (time.monotonic() - started)))


class StreamLivenessTrigger(PollingTrigger):
    """
    Fires ``ok`` when the pipeline's newest progress row is at most ``max_age_seconds`` old.

    :param pipeline: pipeline name.
    :param max_age_seconds: the newest progress row must be younger than this.
    :param postgres_conn_id: target database connection, default "eos_postgres".
    :param meta_schema: schema of the bookkeeping tables.
    :param poke_interval: seconds between checks.
    :param timeout_seconds: fire ``timeout`` (with the last report) after this long; 0: never.
    """

    def __init__(self, pipeline: str, max_age_seconds: float, postgres_conn_id: str = "eos_postgres",
                 meta_schema: str = DEFAULT_SCHEMA, poke_interval: float = 10.0, timeout_seconds: float = 0) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.max_age_seconds = float(max_age_seconds)
        self.postgres_conn_id = postgres_conn_id
        self.meta_schema = meta_schema
        self.poke_interval = float(poke_interval)
        self.timeout_seconds = float(timeout_seconds)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "pipeline": self.pipeline, "max_age_seconds": self.max_age_seconds,
            "postgres_conn_id": self.postgres_conn_id, "meta_schema": self.meta_schema,
            "poke_interval": self.poke_interval, "timeout_seconds": self.timeout_seconds,
        })

    def check(self) -> dict[str, Any]:
        from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
        from airflow_provider_eos.state.progress import latest_progress

        hook = EosPostgresHook(postgres_conn_id=self.postgres_conn_id, meta_schema=self.meta_schema)
        return liveness_report(latest_progress(hook, self.pipeline), self.max_age_seconds)


class StreamCaughtUpTrigger(PollingTrigger):
    """
    Fires ``ok`` when, on every partition of ``topics``, the pipeline's stored next offset is
    within ``max_lag`` of the last stable offset (read with ``ListOffsets`` READ_COMMITTED).

    :param pipeline: pipeline name.
    :param topics: the pipeline's topics.
    :param max_lag: largest acceptable lag per partition.
    :param kafka_config_id: Kafka connection, default "kafka_default".
    :param postgres_conn_id: target database connection, default "eos_postgres".
    :param meta_schema: schema of the bookkeeping tables.
    :param poke_interval: seconds between checks.
    :param timeout_seconds: fire ``timeout`` (with the last lag report) after this long; 0: never.
    :param request_timeout: seconds allowed for each Kafka Admin request.
    :param target_offsets: ``{topic: {partition: offset}}`` to reach instead of the current LSO
        (e.g. the LSO a replay started from); Kafka is not read then.
    """

    def __init__(self, pipeline: str, topics: Sequence[str], max_lag: int = 0,
                 kafka_config_id: str = "kafka_default", postgres_conn_id: str = "eos_postgres",
                 meta_schema: str = DEFAULT_SCHEMA, poke_interval: float = 10.0, timeout_seconds: float = 0,
                 request_timeout: float = 10.0, target_offsets: dict[str, dict[str, int]] | None = None) -> None:
        super().__init__()
        self.target_offsets = target_offsets or None
        self.pipeline = pipeline
        self.topics = list(topics)
        self.max_lag = int(max_lag)
        self.kafka_config_id = kafka_config_id
        self.postgres_conn_id = postgres_conn_id
        self.meta_schema = meta_schema
        self.poke_interval = float(poke_interval)
        self.timeout_seconds = float(timeout_seconds)
        self.request_timeout = float(request_timeout)
        self._kafka: Any = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "pipeline": self.pipeline, "topics": list(self.topics), "max_lag": self.max_lag,
            "kafka_config_id": self.kafka_config_id, "postgres_conn_id": self.postgres_conn_id,
            "meta_schema": self.meta_schema, "poke_interval": self.poke_interval,
            "timeout_seconds": self.timeout_seconds, "request_timeout": self.request_timeout,
            "target_offsets": self.target_offsets,
        })

    def check(self) -> dict[str, Any]:
        return caught_up_check(self, self.pipeline, self.topics, self.max_lag, self.target_offsets)


class TargetOffset(NamedTuple):
    """An offset to reach, shaped like the LSO ``lag_report`` reads."""

    last_stable: int
    earliest: int | None = None


def caught_up_check(owner: Any, pipeline: str, topics: Sequence[str], max_lag: int,
                    target_offsets: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """Reads stored offsets and LSOs (one ListOffsets request per isolation level) and reports the lag;
    with ``target_offsets`` the lag is to those offsets, and Kafka is not read.

    ``owner`` caches its KafkaOffsetsHook in ``owner._kafka`` and carries the connection ids."""
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
    from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
    from airflow_provider_eos.state.offsets import stored_offsets

    offsets: dict[tuple[str, int], Any]
    if target_offsets:
        offsets = {key: TargetOffset(offset) for key, offset in from_nested(target_offsets).items()}
    else:
        if owner._kafka is None:
            owner._kafka = KafkaOffsetsHook(kafka_config_id=owner.kafka_config_id, timeout=owner.request_timeout)
        offsets = owner._kafka.partition_offsets(topics, include_earliest=True)
    stored = stored_offsets(EosPostgresHook(postgres_conn_id=owner.postgres_conn_id, meta_schema=owner.meta_schema),
                            pipeline)
    return lag_report(stored, offsets, max_lag)
