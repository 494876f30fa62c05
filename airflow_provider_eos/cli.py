"""``eos``: check pipeline definitions in a platform team's own CI, before they are deployed.

``eos validate DIR``
    reads every definition in DIR as the DAG processor will: fields, schedules, everything the
    app's start would refuse from the config alone (``config_rules``: the spec imports, an
    aggregate target needs ``exactly_once``...), and that no pipeline claims a target table, a
    meta schema or a checkpoint directory an older one owns. Needs no Airflow deployment and no
    network. Exit 1 if any file is refused.

``eos preflight NAME [--dir DIR]``
    checks one pipeline against what it will run on, through the deployment's Airflow
    connections: Kafka reachable with the connection's credentials and the topics there (and
    the credentials translatable for Spark's Java client); PostgreSQL reachable, UTF8, the
    targets present (or ``create_targets``), ``max_prepared_transactions`` for ``two_phase``;
    the snapshot store there (a local one created private as a snapshot would) and writable
    (a file written and deleted); the pyspark pairing where
    spark-submit would run. Exit 1 if a check fails.

``eos config NAME [--dir DIR] [--no-connections]``
    prints the app config (JSON) the definition yields, as the stream task builds it: Kafka's
    bootstrap servers and the database (host, port, dbname, user; never the password) from the
    pipeline's Airflow connections. The audit and the app take it as ``--config FILE``. With
    ``--no-connections`` both stay empty and no connection is looked up.

``eos offsets reset NAME --to earliest --reason "..." [--yes]``
    moves a pipeline's stored offsets past records Kafka no longer holds, recording each skipped
    range for the audit (``cli_offsets``; docs/streaming_app.md, "Lost data").

``eos --version`` prints the provider's version.

Each line says ``ok`` or ``FAIL`` and what was found; nothing prints a secret.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition

Check = tuple[str, Callable[[], str]]


def validate(directory: str, out: TextIO) -> int:
    """Prints one line per definition file; 1 if any is refused."""
    from airflow_provider_eos.utils.definition_folder import FIX_THE_ARGUMENT, load_definitions
    from airflow_provider_eos.utils.pipeline_definition import PipelineDefinitionError

    try:
        definitions, errors = load_definitions(directory, FIX_THE_ARGUMENT)
    except PipelineDefinitionError as exc:
        print(f"FAIL {exc}", file=out)
        return 1
    for name in sorted(definitions):
        print(f"ok   {name}", file=out)
    for file_name, error in sorted(errors.items()):
        print(f"FAIL {file_name}: {error}", file=out)
    if not definitions and not errors:
        print(f"FAIL no pipeline definitions in {directory}", file=out)
        return 1
    return 1 if errors else 0


def run_checks(checks: Sequence[Check], out: TextIO) -> int:
    """Runs every check (one failing never hides the next); 1 if any failed."""
    failed = 0
    for label, check in checks:
        try:
            print(f"ok   {label}: {check()}", file=out)
        except Exception as exc:  # every check's failure is reported, whatever raised it
            failed += 1
            print(f"FAIL {label}: {exc}", file=out)
    return 1 if failed else 0


def preflight_checks(name: str, directory: str | None) -> list[Check]:
    """The checks of ``eos preflight`` for pipeline ``name``."""
    from airflow_provider_eos.utils import provider_config
    from airflow_provider_eos.utils.definition_folder import definitions_root, find_definition, load_definitions

    root, fix = definitions_root(directory)
    definition = find_definition(root, name, fix)
    connections = definition.connections.resolved(provider_config.connection_defaults())

    def definition_check() -> str:
        _definitions, errors = load_definitions(root, fix)
        mine = [error for file_name, error in errors.items() if Path(file_name).stem == name]
        if mine:
            raise ValueError("; ".join(mine))
        what = f"spec {definition.spec} imports" if definition.mirror is None else "its mirror section parses"
        return f"{root}: valid, {what}, no place shared with another pipeline"

    def snapshot_store_check() -> str:
        from airflow_provider_eos.recovery.store import SnapshotStore

        url = provider_config.snapshot_store()
        directory, created = SnapshotStore(url).probe(definition.name)
        return f"[eos] snapshot_store = {url}: {'created' if created else 'exists'}, {directory} writable"

    def spark_check() -> str:
        from spark_apps.eos_stream.run.pyspark_pairing import installed_versions, pairing_problem

        versions = installed_versions()
        problem = pairing_problem(versions)
        if problem:
            raise ValueError(problem)
        return ", ".join(f"{package} {version}" for package, version in sorted(versions.items()) if version)

    return [("definition", definition_check), ("kafka", lambda: _kafka_check(definition, connections)),
            ("postgres", lambda: _postgres_check(definition, connections)),
            ("snapshot store", snapshot_store_check), ("spark", spark_check)]


def _kafka_check(definition: PipelineDefinition, connections: Any) -> str:
    """The topics exist, with the connection's security the app gets (a mirror's pattern: the
    topics it matches now)."""
    from airflow_provider_eos.hooks.kafka_connection import kafka_client_settings
    from airflow_provider_eos.utils.subscription import subscription_of
    from spark_apps.eos_stream.kafka import security as kafka_security
    from spark_apps.eos_stream.run import preflight

    kafka = kafka_client_settings(connections.kafka)  # what the app itself gets
    kafka_security.java_options(kafka.security)  # Spark's source must be able to use them too
    partitions = preflight.kafka_partitions(kafka.bootstrap, list(definition.topics), kafka.security,
                                            pattern=subscription_of(definition))
    return (f"connection {connections.kafka!r}: " +
            ", ".join(f"{topic} ({len(p)} partitions)" for topic, p in sorted(partitions.items())))


def _postgres_check(definition: PipelineDefinition, connections: Any) -> str:
    """The target database takes the pipeline's delivery mode and targets."""
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
    from airflow_provider_eos.utils.definition_checks import load_spec
    from spark_apps.eos_stream.run import preflight
    from spark_apps.eos_stream.sink.in_doubt import max_prepared_transactions
    from spark_apps.eos_stream.sink.modes import MODES

    hook = EosPostgresHook(postgres_conn_id=connections.postgres, meta_schema=definition.meta_schema)
    conn = hook.connect(application_name="eos-preflight")
    where = f"connection {connections.postgres!r}"
    try:
        preflight.check_encoding(conn, where)
        found = ["UTF8"]
        mode = MODES[definition.delivery]
        if mode.two_phase:
            preflight.check_two_phase(conn, mode, where)
            found.append(f"max_prepared_transactions {max_prepared_transactions(conn)}")
        if definition.stream.create_targets:
            found.append(f"targets in {definition.target_schema} created at the first start")
        else:
            preflight.check_targets(conn, load_spec(definition), definition.target_schema, mode)
            found.append(f"targets present in {definition.target_schema}")
    finally:
        conn.close()
    return f"{where}: " + ", ".join(found)


class ConnectionLookupError(RuntimeError):
    """``eos config`` could not read a pipeline's Airflow connections."""


def app_config(name: str, directory: str | None, with_connections: bool = True) -> dict[str, Any]:
    """The app config pipeline ``name``'s definition yields (no secret in it)."""
    from airflow_provider_eos.utils import provider_config
    from airflow_provider_eos.utils.definition_folder import definitions_root, find_definition

    root, fix = definitions_root(directory)
    definition = find_definition(root, name, fix)
    if not with_connections:
        return definition.app_config(kafka_bootstrap="", postgres={})
    from airflow_provider_eos.hooks.app_config import complete_app_config

    connections = definition.connections.resolved(provider_config.connection_defaults())
    try:
        # The stream task's own call; its JSON is what the app gets (no password, no Kafka options).
        config = complete_app_config(definition, kafka_config_id=connections.kafka, postgres=connections.postgres)
        return dict(json.loads(config.to_json()))
    except Exception as exc:  # a connection missing or unusable: say how to see the config without them
        raise ConnectionLookupError(
            f"{type(exc).__name__}: {exc} (the pipeline's connections: kafka {connections.kafka!r}, postgres "
            f"{connections.postgres!r}; define them in Airflow, or run `eos config {name} --no-connections` "
            "for the config without Kafka's and the database's addresses)") from exc


def print_app_config(name: str, directory: str | None, with_connections: bool, out: TextIO) -> int:
    """``eos config``: the JSON on ``out``, or one FAIL line and 1."""
    try:
        config = app_config(name, directory, with_connections)
    except Exception as exc:  # no such pipeline, an unreadable definition, a missing connection
        print(f"FAIL {name}: {exc}", file=out)
        return 1
    print(json.dumps(config, indent=2, sort_keys=True), file=out)
    return 0


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    from airflow_provider_eos import __version__

    parser = argparse.ArgumentParser(prog="eos", description="Check exactly-once pipeline definitions.")
    parser.add_argument("--version", action="version", version=f"eos (airflow-provider-eos) {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("validate", help="check every definition in a directory (no network)")
    check.add_argument("directory")
    pre = commands.add_parser("preflight", help="check one pipeline against its Kafka, PostgreSQL and Spark")
    pre.add_argument("name")
    pre.add_argument("--dir", help="definition directory (default: [eos] pipeline_config_dir)")
    show = commands.add_parser("config", help="print the app config (JSON) a definition yields")
    show.add_argument("name")
    show.add_argument("--dir", help="definition directory (default: [eos] pipeline_config_dir)")
    show.add_argument("--no-connections", action="store_true",
                      help="leave Kafka's bootstrap servers and the database empty; look up no connection")
    from airflow_provider_eos import cli_offsets

    cli_offsets.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "offsets":
        return cli_offsets.reset(args, out)
    if args.command == "validate":
        return validate(args.directory, out)
    if args.command == "config":
        return print_app_config(args.name, args.dir, not args.no_connections, out)
    try:
        checks = preflight_checks(args.name, args.dir)
    except Exception as exc:  # no such pipeline, an unreadable definition: say so, exit 1
        print(f"FAIL {args.name}: {exc}", file=out)
        return 1
    return run_checks(checks, out)


if __name__ == "__main__":
    sys.exit(main())
