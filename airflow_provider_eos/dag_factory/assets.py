"""A pipeline's topics and target tables as Airflow Assets, and the watcher that says
"the target now holds everything Kafka committed below these offsets".

URIs follow the Kafka and Postgres providers' schemes (their ``create_asset`` factories):
``kafka://<first bootstrap server>/<topic>`` and ``postgres://<host>:<port>/<db>/<schema>/<table>``,
from the pipeline's connections. Every target asset carries the same
:class:`~airflow_provider_eos.triggers.committed_offsets.CommittedOffsetsTrigger` watcher, so
Airflow runs one trigger per pipeline and puts each of its events on every target table.
Airflow runs a watcher only while an active (unpaused) DAG is scheduled on its asset, so a
pipeline nobody consumes costs nothing.

Every DAG that names a target asset must take it from :func:`pipeline_assets`: Airflow keeps one
set of watchers per asset, and an asset spelt without them in another DAG would drop them.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from airflow.sdk import Asset, AssetWatcher

from airflow_provider_eos.dag_factory.common import connection_ids
from airflow_provider_eos.triggers.committed_offsets import CommittedOffsetsTrigger
from airflow_provider_eos.utils import provider_config
from airflow_provider_eos.utils.definition_folder import find_definition
from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition
from spark_apps.eos_stream.records.spec import spec_of

log = logging.getLogger(__name__)
# Seconds between the watcher's reads of the offsets table. A constant: the trigger's kwargs
# identify it, and every DAG naming the asset must build the same one.
WATCH_INTERVAL = 5.0


class PipelineAssets(NamedTuple):
    """The pipeline's topics (what it reads) and target tables (what it writes, with the watcher)."""

    topics: list[Asset]
    targets: list[Asset]


def pipeline_assets(definition: PipelineDefinition) -> PipelineAssets | None:
    """The pipeline's assets, or ``None`` (logged) when its connections or spec cannot be read
    where the DAG file is parsed: the pipeline's DAGs still work, without assets."""
    from airflow.providers.apache.kafka.assets.kafka import create_asset as kafka_asset
    from airflow.providers.postgres.assets.postgres import create_asset as postgres_asset

    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
    from airflow_provider_eos.hooks.kafka_connection import kafka_bootstrap_from_connection
    from airflow_provider_eos.utils.lineage import first_bootstrap_server

    conns = connection_ids(definition)
    try:
        spec = spec_of(definition)
        server = first_bootstrap_server(kafka_bootstrap_from_connection(conns.kafka))
        db = EosPostgresHook(postgres_conn_id=conns.postgres).app_target()
        topics = [kafka_asset(server=server, topic=topic) for topic in definition.topics]
        uris = [postgres_asset(host=db["host"], port=int(db["port"]), database=db["dbname"],
                               schema=definition.target_schema, table=table).uri for table in spec.target_tables()]
    except Exception as err:
        log.warning("eos: pipeline %s has no assets: %s", definition.name, err)
        return None
    watcher = AssetWatcher(
        name=f"eos_committed__{definition.name}",
        trigger=CommittedOffsetsTrigger(pipeline=definition.name, postgres_conn_id=conns.postgres,
                                        meta_schema=definition.meta_schema, asset_names=uris,
                                        poke_interval=WATCH_INTERVAL),
    )
    targets = [Asset(name=uri, uri=uri, watchers=[watcher]) for uri in uris]
    return PipelineAssets(topics=topics, targets=targets)


def committed_assets(pipeline: str) -> list[Asset]:
    """The target assets of ``pipeline`` (defined in ``[eos] pipeline_config_dir``), for a downstream
    DAG's ``schedule``: it runs after each move of the pipeline's committed offsets, and its
    ``triggering_asset_events`` carry them (``extra["payload"]``).

    :raises ValueError: when the pipeline's assets cannot be built here (see the log)."""
    definition = find_definition(provider_config.pipeline_config_dir(), pipeline)
    assets = pipeline_assets(definition)
    if assets is None:
        raise ValueError(f"pipeline {pipeline!r}: its assets cannot be built (connections or spec unreadable)")
    return assets.targets
