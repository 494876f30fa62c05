"""``eos offsets reset``: move a pipeline's stored offsets on purpose, after Kafka lost records.

``eos offsets reset NAME --to earliest --reason "..." [--partition TOPIC:P ...] [--force] [--yes]``
    A run whose stored offset Kafka no longer holds exits 4 (``data_lost``) and is not
    restarted. This moves the stored offset of each such partition to Kafka's log start
    (``--to earliest``) or end (``--to latest``), and records every skipped range, with the
    reason, who and when, in the meta schema's ``accepted_gaps`` table, in the same transaction
    as the offset change and an epoch bump. The audit then reports those ranges as an accepted
    gap. Refused while a driver of the pipeline runs. Partitions whose stored offset Kafka still
    holds move only with ``--force``. Without ``--yes`` it prints the plan and changes nothing.

The pipeline's Kafka and database come from its definition's Airflow connections, or, with
``--config FILE``, from an app config (``eos config``), the password from ``EOS_PG_PASSWORD``.
"""

from __future__ import annotations

import argparse
import getpass
import socket
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from spark_apps.eos_stream.kafka.partitions import TopicPartition


def add_parser(commands: Any) -> None:
    """Adds ``offsets reset`` to ``eos``'s subcommands."""
    offsets = commands.add_parser("offsets", help="move a pipeline's stored offsets (after lost data)")
    actions = offsets.add_subparsers(dest="offsets_command", required=True)
    reset = actions.add_parser("reset", help="move stored offsets Kafka no longer holds; records the skipped ranges")
    reset.add_argument("name")
    reset.add_argument("--to", required=True, choices=("earliest", "latest"),
                       help="Kafka's log start (earliest offset still held) or end")
    reset.add_argument("--reason", required=True, help="why the records are skipped (recorded with each range)")
    reset.add_argument("--partition", action="append", default=[], metavar="TOPIC:P",
                       help="only this partition (repeatable); default: every partition with lost data")
    reset.add_argument("--force", action="store_true", help="also move partitions whose offset Kafka still holds")
    reset.add_argument("--yes", action="store_true", help="make the change (without it: print the plan only)")
    reset.add_argument("--dir", help="definition directory (default: [eos] pipeline_config_dir)")
    reset.add_argument("--config", help="an app config JSON (eos config) instead of the definition's connections")


def parse_partitions(values: list[str]) -> set[TopicPartition] | None:
    """``TOPIC:P`` values as partitions (None when there are none: every lost partition)."""
    found = set()
    for value in values:
        topic, _, number = value.rpartition(":")
        if not topic or not number.isdigit():
            raise ValueError(f"--partition {value!r}: expected TOPIC:PARTITION, e.g. events:0")
        found.add((topic, int(number)))
    return found or None


def _target(args: argparse.Namespace) -> tuple[str, str, Callable[[], Any], tuple[str, Mapping[str, str]]]:
    """Pipeline name, meta schema, a connection factory and Kafka (bootstrap, options)."""
    if args.config:
        from spark_apps.eos_stream.run.config import parse_args
        from spark_apps.eos_stream.sink.postgres import connect

        config = parse_args(["--config", args.config])
        if config.pipeline != args.name:
            raise ValueError(f"{args.config} is the config of pipeline {config.pipeline!r}, not {args.name!r}")
        return (config.pipeline, config.meta_schema,
                lambda: connect(config.postgres.dsn_kwargs(), describe=config.postgres.describe()),
                (config.kafka_bootstrap, config.librdkafka_options()))
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
    from airflow_provider_eos.hooks.kafka_connection import kafka_client_settings
    from airflow_provider_eos.utils import provider_config
    from airflow_provider_eos.utils.definition_folder import definitions_root, find_definition

    root, fix = definitions_root(args.dir)
    definition = find_definition(root, args.name, fix)
    connections = definition.connections.resolved(provider_config.connection_defaults())
    hook = EosPostgresHook(postgres_conn_id=connections.postgres, meta_schema=definition.meta_schema)
    kafka = kafka_client_settings(connections.kafka)
    return (definition.name, definition.meta_schema, lambda: hook.connect(application_name="eos-offsets-reset"),
            (kafka.bootstrap, kafka.security))


def reset(args: argparse.Namespace, out: TextIO) -> int:
    """``eos offsets reset``: one line per move and a summary; 1 when refused."""
    from spark_apps.eos_stream.run.offsets_reset import Move, reset_offsets

    who = f"{getpass.getuser()}@{socket.gethostname()}"
    try:
        pipeline, meta_schema, connect, kafka = _target(args)
        result = reset_offsets(connect, meta_schema, pipeline, kafka, to=args.to, reason=args.reason, who=who,
                               only=parse_partitions(args.partition), force=args.force, apply=args.yes)
    except Exception as exc:  # refused, running, unreachable: nothing changed
        print(f"FAIL {args.name}: {exc}", file=out)
        return 1
    moves = [Move(**m) for m in result["moves"]]
    if not moves:
        print(f"ok   {pipeline}: nothing to move: every stored offset is held by Kafka"
              + ("" if args.force else " (--force moves them anyway)"), file=out)
        return 0
    for move in moves:
        print(f"{'moved' if result['applied'] else 'would move'} {move.describe()}", file=out)
    if result["applied"]:
        print(f"ok   {pipeline}: {len(moves)} partition(s) moved, epoch {result['epoch']}; the skipped ranges are "
              f"recorded in {meta_schema}.accepted_gaps (reason {args.reason!r}, by {who})", file=out)
    else:
        print(f"plan {pipeline}: nothing changed; run again with --yes to move them", file=out)
    return 0
