"""Debezium's PostgreSQL connector as this project configures it (docs/cdc.md, "Connector
settings"): one function, so that the demo and the tests create the same connector."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from spark_apps.eos_stream.cdc.transactions import transaction_topic as topic_of

# The project's Connect predicate (connect/, built by scripts/install.sh into the worker's plugin path).
TRANSACTION_BEGIN_PREDICATE = "eos.connect.RecordIsTransactionBegin"


def postgres_connector_config(source: Mapping[str, str], topic_prefix: str, slot: str, tables: list[str],
                              *, drop_transaction_begins: bool = True, **extra: Any) -> dict[str, Any]:
    """The connector's config, capturing ``tables`` (``schema.table``) into topics
    ``<topic_prefix>.<schema>.<table>``.

    :param source: the source's settings as ``scripts/stack.sh`` writes them to ``stack.env``
        (``EOS_PG_HOST``, ``EOS_PG_PORT``, ``EOS_SOURCE_PG_DB``, ``EOS_SOURCE_PG_USER``,
        ``EOS_SOURCE_PUBLICATION``, ``EOS_CONNECT_SOURCE_SECRETS``).
    :param slot: the replication slot the connector creates and holds.
    :param drop_transaction_begins: drop the transaction topic's BEGIN records before they are
        written (Connect's ``Filter`` with the project's ``eos.connect.RecordIsTransactionBegin``
        predicate, which the worker must have in its plugin path). A mirror reads only the ENDs;
        the BEGINs cost it reading time. False for a worker without the plugin.
    :param extra: more connector settings, winning over these (a ``transforms`` of your own
        replaces the BEGINs' filter: name ``dropTransactionBegins`` in it to keep it).
    """
    transaction_topic = topic_of(topic_prefix)
    return {
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "tasks.max": 1,
        "plugin.name": "pgoutput",
        "database.hostname": source["EOS_PG_HOST"],
        "database.port": source["EOS_PG_PORT"],
        "database.user": source["EOS_SOURCE_PG_USER"],
        # Resolved inside the worker by its FileConfigProvider: the password is never in the
        # stored config, on a command line or in a log.
        "database.password": f"${{file:{source['EOS_CONNECT_SOURCE_SECRETS']}:password}}",
        "database.dbname": source["EOS_SOURCE_PG_DB"],
        "topic.prefix": topic_prefix,
        "table.include.list": ",".join(tables),
        "slot.name": slot,
        "publication.name": source["EOS_SOURCE_PUBLICATION"],
        "publication.autocreate.mode": "disabled",
        "snapshot.mode": "initial",
        "exactly.once.support": "required",
        "decimal.handling.mode": "string",
        "heartbeat.interval.ms": 1000,
        "topic.creation.default.replication.factor": 1,
        "topic.creation.default.partitions": 1,
        # BEGIN/END per source transaction in <topic_prefix>.transaction, for a mirror with
        # transactions: whole. That topic keeps one partition whatever the default group says: only
        # there are its records in the source's commit order (the app refuses more).
        "provide.transaction.metadata": "true",
        "topic.creation.groups": "transaction",
        "topic.creation.transaction.include": re.escape(transaction_topic),
        "topic.creation.transaction.partitions": 1,
        "topic.creation.transaction.replication.factor": 1,
        **(begins_filter(transaction_topic) if drop_transaction_begins else {}),
        **extra,
    }


def begins_filter(transaction_topic: str) -> dict[str, str]:
    """Connector settings that drop ``transaction_topic``'s BEGIN records. Debezium counts each
    transaction's events before any transform, so every END still counts them all."""
    return {
        "transforms": "dropTransactionBegins",
        "transforms.dropTransactionBegins.type": "org.apache.kafka.connect.transforms.Filter",
        "transforms.dropTransactionBegins.predicate": "transactionBegin",
        "predicates": "transactionBegin",
        "predicates.transactionBegin.type": TRANSACTION_BEGIN_PREDICATE,
        "predicates.transactionBegin.topic": transaction_topic,
    }
