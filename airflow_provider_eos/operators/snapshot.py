"""SnapshotOperator: one consistent dump of a pipeline's tables and replay point."""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import cached_property
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos import __version__
from airflow_provider_eos.hooks.snapshot import LOCK_TABLE, SnapshotHook, target_lock_key
from airflow_provider_eos.recovery_lock import DEFAULT_LOCK_TTL, holder_of, holding_lock
from airflow_provider_eos.snapshots import (
    SnapshotError,
    SnapshotManifest,
    SnapshotStore,
    load_pipeline_config,
    new_snapshot_id,
    sha256_file,
)


def timed_step(execute: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Adds ``step_seconds`` to a dict XCom: the recovery summary reports time per step from it."""

    @functools.wraps(execute)
    def wrapper(self: Any, context: Any) -> Any:
        started = time.monotonic()
        result = execute(self, context)
        if isinstance(result, dict):
            result = {**result, "step_seconds": round(time.monotonic() - started, 3)}
        return result

    return wrapper


class PipelineOperatorMixin:
    """Shared by the recovery operators: the pipeline config and the snapshot hook."""

    pipeline_config: Any
    postgres_conn_id: str
    pg_bin_dir: str | None
    # Steps of a recovery run hold the target's recovery lock (see recovery_lock.py).
    hold_lock: bool = False
    lock_ttl: float = DEFAULT_LOCK_TTL
    # When set, Kafka's bootstrap servers come from this connection, not from the config.
    kafka_config_id: str | None = None

    @cached_property
    def hook(self) -> SnapshotHook:
        return SnapshotHook(postgres_conn_id=self.postgres_conn_id, pg_bin_dir=self.pg_bin_dir)

    def resolve_store(self) -> SnapshotStore:
        """The store this step reads or writes: its own ``snapshot_store``, else the deployment's
        ``[eos] snapshot_store``, resolved now rather than when the DAG file was parsed."""
        from airflow_provider_eos import settings

        return SnapshotStore(getattr(self, "snapshot_store", None) or settings.snapshot_store())

    def load_config(self) -> Any:
        try:
            return load_pipeline_config(self.pipeline_config)
        except SnapshotError as exc:
            raise AirflowException(str(exc)) from exc

    def app_config(self) -> Any:
        """The pipeline config with the database taken from the Airflow connection
        (password included, for in-process use only), and Kafka's bootstrap servers from
        ``kafka_config_id`` when the operator has one."""
        config = self.load_config()
        if self.kafka_config_id:
            from airflow_provider_eos.operators.stream import kafka_bootstrap_from_connection

            config.kafka_bootstrap = kafka_bootstrap_from_connection(self.kafka_config_id)
        params = self.hook.libpq_params()
        config.postgres.host = params["host"]
        config.postgres.port = params["port"]
        config.postgres.dbname = params["dbname"]
        config.postgres.user = params["user"]
        config.postgres.password = self.hook.connection.password
        return config

    def lock_key(self, config: Any) -> str:
        return target_lock_key(self.hook.dbname, config.target_schema, config.pipeline)

    def lock_guard(self, config: Any, context: Any) -> AbstractContextManager[Any]:
        """Holds the recovery lock for this run while the step works (when ``hold_lock``)."""
        if not self.hold_lock:
            return nullcontext({})
        return holding_lock(self.hook, config.meta_schema, self.lock_key(config), holder_of(context),
                            float(self.lock_ttl))


def snapshot_tables(hook: SnapshotHook, conn: Any, config: Any) -> tuple[list[tuple[str, str]], dict]:
    """The pipeline's target tables (from its spec; all must exist) and every
    bookkeeping table except staging leftovers and operational state: the
    control table (a restore must not undo a stop request), the epochs (a
    restore must never move an epoch back: a fenced driver would own the
    target again), the recovery locks and the health check's LSO watch (Kafka's state, not the
    data's: a restore must not make a hanging transaction look younger)."""
    from spark_apps.eos_stream import meta_tables
    from spark_apps.eos_stream.spec import load_spec

    spec = load_spec(config.spec)
    present = set(hook.list_tables(conn, config.target_schema))
    wanted = [t.table for t in spec.targets]
    missing = [t for t in wanted if t not in present]
    if missing:
        raise AirflowException(
            f"pipeline {config.pipeline!r}: target tables {missing} do not exist in schema {config.target_schema!r} "
            f"of database {hook.dbname!r}"
        )
    excluded = {meta_tables.CONTROL, meta_tables.EPOCHS, meta_tables.LSO_WATCH, LOCK_TABLE}
    meta = [t for t in hook.list_tables(conn, config.meta_schema)
            if t not in excluded and not t.startswith("stage_")]  # staging leftovers
    if meta_tables.OFFSETS not in meta:
        raise AirflowException(f"pipeline {config.pipeline!r}: no {config.meta_schema}.{meta_tables.OFFSETS} table; "
                               "has the pipeline ever run in exactly_once mode?")
    tables = [(config.target_schema, t) for t in wanted] + [(config.meta_schema, t) for t in meta]
    roles = {(config.target_schema, t): "target" for t in wanted} | {(config.meta_schema, t): "meta" for t in meta}
    return tables, roles


class SnapshotOperator(PipelineOperatorMixin, BaseOperator):
    """
    Takes one consistent snapshot of a pipeline into a snapshot store, then
    applies retention.

    The dump, the row counts and checksums in its manifest and the stored Kafka
    offsets all come from one exported PostgreSQL snapshot, so the dump carries
    its own replay point. It holds the target's swap lock shared from before
    that snapshot is taken until the dump ends: a snapshot started during a
    restore's swap waits for the swap's commit (and never sees half-swapped
    or empty tables), and a swap waits for the snapshot. Returns the manifest
    summary (XCom).

    :param pipeline_config: the pipeline's config, a dict or a JSON file path (templated).
    :param snapshot_store: local directory or object storage URL (templated); default: the deployment's
        ``[eos] snapshot_store``, read at execute time.
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param keep_last: keep the newest N snapshots of the pipeline (0: keep all).
    :param pg_bin_dir: directory of pg_dump/pg_restore/psql (default: PATH or EOS_PG_BIN_DIR).
    """

    template_fields: Sequence[str] = ("pipeline_config", "snapshot_store", "keep_last")
    ui_color = "#e8f4ea"

    def __init__(
        self,
        *,
        pipeline_config: Any,
        snapshot_store: Any = None,
        postgres_conn_id: str = "eos_postgres",
        keep_last: int | str = 24,
        pg_bin_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pipeline_config = pipeline_config
        self.snapshot_store = snapshot_store
        self.postgres_conn_id = postgres_conn_id
        self.keep_last = keep_last
        self.pg_bin_dir = pg_bin_dir

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        store = self.resolve_store()
        started = time.monotonic()
        snapshot_id = new_snapshot_id()
        conn = self.hook.connect()
        try:
            tables, roles = snapshot_tables(self.hook, conn, config)
        finally:
            conn.close()
        with tempfile.TemporaryDirectory(prefix="eos-snapshot-") as tmp:
            dump_file = Path(tmp) / "dump.pgc"
            # The swap lock, shared: a restore's swap of this target never runs under the snapshot.
            state = self.hook.dump_consistent(
                tables, roles, dump_file, meta_schema=config.meta_schema, pipeline=config.pipeline,
                lock_key=self.lock_key(config),
            )
            manifest = SnapshotManifest(
                snapshot_id=snapshot_id,
                created_at=state.created_at,
                pipeline=config.pipeline,
                database=state.database,
                target_schema=config.target_schema,
                meta_schema=config.meta_schema,
                tables=state.tables,
                kafka_offsets=state.offsets,
                dump_bytes=dump_file.stat().st_size,
                dump_sha256=sha256_file(dump_file),
                app_version=__version__,
                server_version=state.server_version,
                other_pipelines=state.other_pipelines,
                timings=state.timings,
            )
            stored_at = time.monotonic()
            store.save(manifest, dump_file)
            manifest.timings["store"] = round(time.monotonic() - stored_at, 3)
        deleted = store.apply_retention(config.pipeline, int(self.keep_last)) if int(self.keep_last) > 0 else []
        self.log.info("snapshot %s of pipeline %s: %d rows in %d tables, %d bytes, offsets %s; retention deleted %s",
                      snapshot_id, config.pipeline, manifest.total_rows, len(manifest.tables), manifest.dump_bytes,
                      manifest.kafka_offsets, deleted or "nothing")
        if manifest.other_pipelines:
            self.log.warning("meta schema %s also holds pipelines %s: restoring this snapshot would roll them back",
                             config.meta_schema, manifest.other_pipelines)
        return {**manifest.summary(), "seconds": round(time.monotonic() - started, 3), "retention_deleted": deleted,
                "store": str(store.base)}
