"""Checks made before Spark starts, each failing with a message that says what to fix.

A wrong mode, a missing table or an unreachable broker is found here in
seconds, instead of as a stack trace from inside a micro-batch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream.kafka.client_logs import with_python_logging
from spark_apps.eos_stream.kafka.metadata import KafkaUnavailable, matching_topics, topic_metadata_problem
from spark_apps.eos_stream.records.spec import SOURCE_COLUMNS, AggregateTarget, PipelineSpec
from spark_apps.eos_stream.run.config import ConfigError, PipelineConfig
from spark_apps.eos_stream.run.config_rules import aggregates_problem, mirror_delivery_problem
from spark_apps.eos_stream.sink.in_doubt import max_prepared_transactions
from spark_apps.eos_stream.sink.modes import MODES, DeliveryMode
from spark_apps.eos_stream.state import meta_tables
from spark_apps.eos_stream.state.ddl import run_ddl


def delivery_mode(config: PipelineConfig, spec: PipelineSpec) -> DeliveryMode:
    problem = aggregates_problem(config, spec) or mirror_delivery_problem(config, spec)
    if problem:
        raise ConfigError(problem)
    return MODES[config.delivery]


def check_two_phase(conn: PgConnection, mode: DeliveryMode, where: str) -> None:
    """two_phase delivery needs prepared transactions, which PostgreSQL disables by default."""
    if mode.two_phase and max_prepared_transactions(conn) == 0:
        raise ConfigError(
            f"delivery 'two_phase' needs PREPARE TRANSACTION, but max_prepared_transactions is 0 on {where}: "
            "set max_prepared_transactions in postgresql.conf (at least one per two_phase pipeline writing "
            "there) and restart PostgreSQL, or use delivery 'exactly_once' (one-phase commit, the same guarantee)"
        )


# Set to 0 to write every batch the staged way (the benchmarks' before/after; tests of the staged path).
PREPARED_PARTS_ENV = "EOS_PREPARED_PARTS"


def prepared_parts(conn: PgConnection, spec: PipelineSpec, mode: DeliveryMode) -> tuple[bool, str]:
    """Whether this pipeline's batches are written as prepared parts (``sink.parts``), and why (not)."""
    from spark_apps.eos_stream.sink import parts

    if mode.name != "exactly_once":
        return False, f"delivery {mode.name!r} writes the staged way"
    if spec.mirror is not None:
        return False, "a mirror upserts and deletes by key, which only the staged way's apply statement does"
    if os.environ.get(PREPARED_PARTS_ENV, "1") == "0":
        return False, f"{PREPARED_PARTS_ENV}=0"
    if not parts.supported(spec):
        return False, ("the spec has a per-record transform, a numeric or double precision field, "
                       "or more than one row target")
    if max_prepared_transactions(conn) == 0:
        return False, ("max_prepared_transactions is 0 on the target server (each batch's tasks need one "
                       "prepared transaction each; two batches' worth per pipeline)")
    return True, "each task writes its share in a prepared transaction"


def check_encoding(conn: PgConnection, where: str) -> None:
    """The target database must store UTF-8. Records are staged as UTF-8 text by the executors;
    a database of another encoding refuses characters it cannot represent (22P05) in that COPY,
    where no single record can be blamed, so every batch holding one would fail (BatchStuck)
    instead of quarantining it. Refused at the start, with the fix."""
    with conn.cursor() as cur:
        cur.execute("SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()")
        row = cur.fetchone()
    conn.rollback()
    encoding = row[0] if row else "unknown"
    if encoding != "UTF8":
        raise ConfigError(
            f"the target database on {where} has encoding {encoding}: the pipeline needs a UTF8 database "
            "(text a record carries must be storable; create the database WITH ENCODING 'UTF8')")


def ensure_meta_tables(conn: PgConnection, meta_schema: str) -> None:
    """Creates the bookkeeping tables, and adds the columns newer versions
    write (``sqlstate`` on dead letters) to tables an older version made."""
    with conn.cursor() as cur:
        # Two apps starting at once must not race on CREATE IF NOT EXISTS.
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended('eos:ddl', 0))")
        run_ddl(cur, [*meta_tables.ddl_statements(meta_schema), *meta_tables.upgrade_statements(meta_schema)])
    conn.commit()


def create_targets(conn: PgConnection, spec: PipelineSpec, target_schema: str, mode: DeliveryMode) -> None:
    if spec.target_ddl is None:
        raise ConfigError(f"spec {spec.name!r} has no target_ddl; create its tables yourself")
    with conn.cursor() as cur:
        run_ddl(cur, spec.target_ddl(target_schema, mode.upsert_rows))
    conn.commit()


def _unique_column_sets(conn: PgConnection, schema: str, table: str) -> list[set[str]]:
    with conn.cursor() as cur:
        cur.execute(
            "SELECT array_agg(a.attname::text) FROM pg_index i"
            " JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
            " JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(i.indkey)"
            " WHERE n.nspname = %s AND c.relname = %s AND i.indisunique GROUP BY i.indexrelid",
            (schema, table),
        )
        return [set(row[0]) for row in cur.fetchall()]


def check_targets(conn: PgConnection, spec: PipelineSpec, target_schema: str, mode: DeliveryMode) -> None:
    """Every target exists, and has the unique keys its writes rely on."""
    tables = spec.target_tables()
    with conn.cursor() as cur:
        for table in tables:
            cur.execute("SELECT to_regclass(%s)", (sql.SQL("{}.{}").format(
                sql.Identifier(target_schema), sql.Identifier(table)).as_string(cur),))
            row = cur.fetchone()
            if row is None or row[0] is None:
                raise ConfigError(
                    f"target table {target_schema}.{table} does not exist in the target database; "
                    "create it (the spec's target_ddl) or run with create_targets=true"
                )
    conn.rollback()
    for target in spec.targets:
        unique_sets = _unique_column_sets(conn, target_schema, target.table)
        if isinstance(target, AggregateTarget):
            if set(target.group_by) not in unique_sets:
                raise ConfigError(
                    f"aggregate target {target_schema}.{target.table} needs a unique constraint on "
                    f"{list(target.group_by)} for its upsert"
                )
        elif mode.upsert_rows and set(SOURCE_COLUMNS) not in unique_sets:
            raise ConfigError(
                f"idempotent delivery needs a unique index on {list(SOURCE_COLUMNS)} of "
                f"{target_schema}.{target.table}"
            )
    conn.rollback()


def kafka_partitions(bootstrap: str, topics: list[str], admin_options: dict[str, str], timeout: float = 15.0,
                     pattern: str | None = None):
    """Partitions per topic from the brokers' metadata: of ``topics``, and of every topic the
    regex ``pattern`` matches (a subscription by pattern, ``PipelineSpec.subscription``).

    :raises ConfigError: the brokers refused the credentials (not retryable: the same
        credentials fail the same way), or a topic does not exist.
    :raises KafkaUnavailable: the brokers cannot be reached (retryable).
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    refused: list[str] = []

    def on_error(error: Any) -> None:
        # librdkafka reports a failed SASL handshake here; list_topics only says it timed out.
        if error.code() in (KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED):
            refused.append(error.str())

    settings: dict[str, Any] = {"bootstrap.servers": bootstrap, **admin_options, "error_cb": on_error}
    admin = AdminClient(with_python_logging(settings))
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        admin.poll(0)  # serves the queued error callbacks
        if refused:
            raise ConfigError(f"Kafka at {bootstrap} refused the credentials ({refused[-1]}); check the "
                              "security options (sasl.username, sasl.password...) of the Kafka connection") from exc
        raise KafkaUnavailable(f"cannot reach Kafka at {bootstrap} within {timeout:.0f}s: {exc}") from exc
    partitions: dict[str, list[int]] = {}
    for topic in topics + matching_topics(metadata.topics, pattern, exclude=topics):
        found = metadata.topics.get(topic)
        problem = topic_metadata_problem(found)
        if problem == "missing":
            raise ConfigError(f"Kafka topic {topic!r} does not exist on {bootstrap}")
        if problem is not None or found is None:
            # Retryable: the supervisor restarts the app, a ConfigError would stop it for good.
            raise KafkaUnavailable(f"Kafka topic {topic!r} on {bootstrap} is temporarily unavailable ({problem}); "
                                   "it exists, but a broker is not serving it yet (a leader election, a "
                                   "restarting broker): retried on the next start")
        partitions[topic] = sorted(found.partitions)
    return partitions


def transaction_topic_problem(topic: str | None, partitions: Mapping[str, list[int]],
                              stored: Mapping[tuple[str, int], int] | None = None) -> str | None:
    """Why a mirror of whole source transactions (``topic``: its transaction topic, ``cdc/transactions``)
    cannot start on these topics' partitions and its ``stored`` offsets, with the fix; None when it can.

    Only one partition keeps the ENDs in the source's commit order, which the walk relies on. A
    mirror that stored offsets of its change topics but none of its transaction topic ran
    ``per_key`` until now: it would read the transaction topic from its start, and wait for ever
    for the events of transactions it applied before."""
    if topic is None:
        return None
    found = partitions.get(topic)
    if not found:
        return (f"the transaction topic {topic!r} does not exist: set provide.transaction.metadata=true on the "
                "connector (postgres_connector_config does), or set mirror.transactions: per_key")
    if len(found) != 1:
        return (f"the transaction topic {topic!r} has {len(found)} partitions: its records are in the source's "
                "commit order only in one. Recreate it with one partition (the connector's topic.creation "
                "group for it, as postgres_connector_config sets) before the connector writes it, and "
                "re-snapshot, or set mirror.transactions: per_key")
    if stored and not any(t == topic for t, _ in stored):
        return (f"this mirror stored offsets of its change topics but none of {topic!r}: it ran with "
                "transactions: per_key, and would now wait for the events of transactions it already applied. "
                "Mirror whole transactions with a new pipeline (its own meta and target schemas, from the "
                "connector's snapshot), or keep mirror.transactions: per_key")
    return None


def is_compacted(cleanup_policy: str | None) -> bool:
    """Whether a topic's ``cleanup.policy`` (``delete``, ``compact`` or ``compact,delete``) compacts it."""
    return "compact" in {p.strip().lower() for p in (cleanup_policy or "").split(",")}


def compacted_topics(admin: Any, topics: list[str], timeout: float = 30.0) -> list[str]:
    """The topics among ``topics`` whose ``cleanup.policy`` compacts them (AdminClient.describe_configs)."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    if not topics:
        return []
    futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in topics],
                                     request_timeout=timeout)
    found = []
    for resource, future in futures.items():
        policy = future.result(timeout).get("cleanup.policy")
        if is_compacted(None if policy is None else policy.value):
            found.append(resource.name)
    return sorted(found)


def refuse_compacted(admin: Any, topics: list[str], what: str) -> None:
    """Raises ConfigError when a topic is compacted. Compaction deletes every record of a key but
    its newest, below the log's cleaner point and at any time: a replay from stored offsets would
    apply only the survivors (increments and rows silently lost), and an audit could not tell a
    record the pipeline lost from one the cleaner removed. Neither is supported on such a topic.

    :param what: what refuses, for the message (``replay``, ``audit``).
    """
    compacted = compacted_topics(admin, topics)
    if compacted:
        raise ConfigError(
            f"{what} refused: Kafka topic(s) {compacted} have cleanup.policy=compact. Compaction removes "
            "all but the newest record of each key, so Kafka no longer holds every record the target was "
            f"built from, and a {what} from offsets cannot be exact. Use cleanup.policy=delete for pipeline "
            "topics (see docs/recovery.md, 'Compacted topics')")
