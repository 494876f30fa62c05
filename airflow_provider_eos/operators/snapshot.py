"""SnapshotOperator: one consistent dump of a pipeline's tables and replay point."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator

from airflow_provider_eos import __version__
from airflow_provider_eos.operators.base import PipelineOperatorMixin, timed_step
from airflow_provider_eos.recovery.dump import take_snapshot


class SnapshotOperator(PipelineOperatorMixin, BaseOperator):
    """
    Takes one consistent snapshot of a pipeline into a snapshot store, then
    applies retention.

    The dump, the row counts and checksums in its manifest and the stored Kafka
    offsets all come from one exported PostgreSQL snapshot, so the dump carries
    its own replay point. It holds the target's swap lock shared from before
    that snapshot is taken until the dump ends: a snapshot started during a
    restore's swap waits for the swap's commit (and never sees half-swapped
    or empty tables), and a swap waits for the snapshot (``recovery.dump``). Before it is
    saved the dump is proven: restored whole into a scratch database and checked against
    the manifest (``recovery.scratch``); a dump that fails is never saved, and a restore of
    one that passed loads its data once. Returns the manifest summary (XCom).

    :param definition: the pipeline (``PipelineDefinition``, its dict, or its name); its complete app config
        comes from one call (``PipelineOperatorMixin.app_config``).
    :param pipeline_config: deprecated (read for one release): the app's config, dict or JSON file path.
    :param snapshot_store: local directory or object storage URL (templated); default: the deployment's
        ``[eos] snapshot_store``, read at execute time.
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param keep_last: keep the newest N snapshots of the pipeline (0: keep all).
    :param pg_bin_dir: directory of pg_dump/pg_restore/psql (default: ``[eos] pg_bin_dir``, else PATH).
    """

    template_fields: Sequence[str] = ("pipeline_config", "snapshot_store", "keep_last")
    ui_color = "#e8f4ea"

    def __init__(
        self,
        *,
        definition: Any = None, pipeline_config: Any = None,
        snapshot_store: Any = None,
        postgres_conn_id: str = "eos_postgres",
        keep_last: int | str = 24,
        pg_bin_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.take_definition(definition, pipeline_config)
        self.snapshot_store = snapshot_store
        self.postgres_conn_id = postgres_conn_id
        self.keep_last = keep_last
        self.pg_bin_dir = pg_bin_dir

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        store = self.resolve_store()
        started = time.monotonic()
        # The swap lock, shared: a restore's swap of this target never runs under the snapshot.
        manifest = take_snapshot(self.hook, store, config, self.lock_key(config), __version__)
        snapshot_id = manifest.snapshot_id
        deleted = store.apply_retention(config.pipeline, int(self.keep_last)) if int(self.keep_last) > 0 else []
        self.log.info("snapshot %s of pipeline %s: %d rows in %d tables, %d bytes, offsets %s; retention deleted %s",
                      snapshot_id, config.pipeline, manifest.total_rows, len(manifest.tables), manifest.dump_bytes,
                      manifest.kafka_offsets, deleted or "nothing")
        if manifest.other_pipelines:
            self.log.warning("meta schema %s also holds pipelines %s: restoring this snapshot would roll them back",
                             config.meta_schema, manifest.other_pipelines)
        return {**manifest.summary(), "seconds": round(time.monotonic() - started, 3), "retention_deleted": deleted,
                "store": str(store.base)}
