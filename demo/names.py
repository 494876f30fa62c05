"""The demo's three pipelines by name: their topics, schemas and DAG ids, and where its logs go.

The DAGs are built by the DAG factory from .local/pipelines/*.yaml (scripts/airflow.sh); the
story checks at its start that those definitions still say what these names say.
"""

from __future__ import annotations

from pathlib import Path

from airflow_provider_eos.links.spark_ui import SparkDriverUILink
from demo.env_files import STATE_DIR

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = "ledger"
TOPIC = "ledger.events"
META, TARGET = "eos", "public"
# The ledger's DAGs, built by the DAG factory from .local/pipelines/ledger.yaml (scripts/airflow.sh).
STREAM, STOP, HEALTH, SNAPSHOT, RECOVERY = (f"eos_{kind}__{PIPELINE}"
                                           for kind in ("stream", "stop", "health", "snapshot", "recovery"))
# The second pipeline (.local/pipelines/orders.yaml): its stream and stop DAGs are the ones used.
ORDERS_PIPELINE, ORDERS_TOPIC = "orders", "orders.events"
ORDERS_META, ORDERS_TARGET = "orders_eos", "orders"
ORDERS_STREAM, ORDERS_STOP = f"eos_stream__{ORDERS_PIPELINE}", f"eos_stop__{ORDERS_PIPELINE}"
# The third (.local/pipelines/shop_mirror.yaml): a mirror of the source database's shop schema,
# which demo/cdc_app.py's application changes and Debezium captures into topics shop.shop.<table>.
MIRROR_PIPELINE, SOURCE_SCHEMA, TOPIC_PREFIX = "shop_mirror", "shop", "shop"
MIRROR_META, MIRROR_TARGET = "shop_mirror_eos", "shop_mirror"
MIRROR_STREAM, MIRROR_STOP = f"eos_stream__{MIRROR_PIPELINE}", f"eos_stop__{MIRROR_PIPELINE}"
# Its connector and replication slot carry the run's start time: Connect keeps a connector's source
# offsets under its name, so a rerun's connector, under a new name, snapshots the fresh tables.
CONNECTOR_PREFIX, SLOT_PREFIX = "demo-shop", "demo_shop"
SPARK_UI_LINK = SparkDriverUILink.name
# Seconds a stream's new Spark driver may take to its first committed batch: well under a minute
# on a quiet 2-core machine, several when three drivers start among other busy processes.
DRIVER_START_BUDGET = 480
# dags/eos_downstream_example.py: scheduled on the ledger's target assets; unpausing it starts the
# pipeline's committed-offsets watcher on the triggerer.
DOWNSTREAM = f"eos_example_downstream__{PIPELINE}"
DAGS = [STREAM, STOP, HEALTH, SNAPSHOT, RECOVERY, ORDERS_STREAM, ORDERS_STOP, MIRROR_STREAM, MIRROR_STOP, DOWNSTREAM]
# Unpaused just before first use: unpausing a scheduled DAG starts a run for its latest interval.
UNPAUSE_AT_START = [STREAM, STOP, HEALTH, RECOVERY, ORDERS_STREAM, ORDERS_STOP, MIRROR_STREAM, MIRROR_STOP,
                    DOWNSTREAM]

# Where the console's log (stderr, Python logging, librdkafka) and failed tasks' logs go.
CONSOLE_LOG = STATE_DIR / "demo" / "story.log"
TASK_LOGS = STATE_DIR / "demo" / "task-logs"
