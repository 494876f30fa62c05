"""Find, describe and (only when confirmed) abort hanging Kafka transactions.

librdkafka (and so confluent-kafka) has no DescribeProducers, ListTransactions or
admin-abort (WriteTxnMarkers) API, so this operator runs Kafka's own
``TransactionsCommand`` (``kafka-transactions.sh``, KIP-664) in a subprocess.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

TOOL_CLASS = "org.apache.kafka.tools.TransactionsCommand"
CLASSPATH_ENV = "EOS_KAFKA_TOOLS_CLASSPATH"
ACTIONS = ("find-hanging", "describe-producers", "abort")

_JAAS_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
# librdkafka keys that only matter to librdkafka and can be ignored for the Java tool.
_IGNORED_KEYS = re.compile(
    r"^(bootstrap\.servers|group\.id|client\.id|.*_cb|enable\..*|auto\..*|socket\..*|"
    r"session\.timeout\.ms|isolation\.level|debug|log_level|"
    r"ssl\.endpoint\.identification\.algorithm)$"
)


def _jaas_quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _properties_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def java_client_properties(config: dict[str, Any], workdir: Path) -> dict[str, str]:
    """
    Translate the security settings of a librdkafka config into Java admin client
    properties (SASL PLAIN/SCRAM with username/password, SSL with PEM files).

    :param config: librdkafka config (the ``kafka`` connection's extra).
    :param workdir: private directory for derived files (PEM key store).
    :raises AirflowException: for settings that cannot be translated; pass them
        through ``command_properties`` instead.
    """
    props: dict[str, str] = {}
    unsupported: list[str] = []
    handled = {
        "security.protocol",
        "sasl.mechanism",
        "sasl.mechanisms",
        "sasl.username",
        "sasl.password",
        "ssl.ca.location",
        "ssl.certificate.location",
        "ssl.key.location",
        "ssl.key.password",
    }
    if "security.protocol" in config:
        props["security.protocol"] = str(config["security.protocol"]).upper()
    mechanism = config.get("sasl.mechanism") or config.get("sasl.mechanisms")
    if mechanism:
        mechanism = str(mechanism).upper()
        props["sasl.mechanism"] = mechanism
    if "sasl.username" in config or "sasl.password" in config:
        module = _JAAS_MODULES.get(mechanism or "PLAIN")
        if module is None:
            unsupported.append(f"sasl.username/sasl.password with sasl.mechanism={mechanism}")
        else:
            props["sasl.jaas.config"] = (
                f"{module} required username={_jaas_quote(str(config.get('sasl.username', '')))} "
                f"password={_jaas_quote(str(config.get('sasl.password', '')))};"
            )
    if "ssl.ca.location" in config:
        props["ssl.truststore.type"] = "PEM"
        props["ssl.truststore.location"] = str(config["ssl.ca.location"])
    if "ssl.certificate.location" in config or "ssl.key.location" in config:
        cert = config.get("ssl.certificate.location")
        key = config.get("ssl.key.location")
        if not (cert and key):
            unsupported.append("ssl.certificate.location without ssl.key.location (or vice versa)")
        else:
            # The Java PEM key store wants the (PKCS#8) key and the certificate chain in one file.
            bundle = workdir / "client-keystore.pem"
            bundle.write_text(Path(key).read_text() + "\n" + Path(cert).read_text())
            bundle.chmod(0o600)
            props["ssl.keystore.type"] = "PEM"
            props["ssl.keystore.location"] = str(bundle)
            if config.get("ssl.key.password"):
                props["ssl.key.password"] = str(config["ssl.key.password"])
    if config.get("ssl.endpoint.identification.algorithm") == "none":
        props["ssl.endpoint.identification.algorithm"] = ""
    for key in config:
        if key in handled or _IGNORED_KEYS.match(key):
            continue
        if key.startswith(("sasl.", "ssl.", "security.")):
            unsupported.append(key)
    if unsupported:
        raise AirflowException(
            "Cannot translate these Kafka connection settings for the Java TransactionsCommand: "
            f"{', '.join(sorted(unsupported))}. Pass the equivalent Java client settings in "
            "command_properties."
        )
    return props


def parse_table(stdout: str) -> list[dict[str, Any]]:
    """Parse the tab-separated table TransactionsCommand prints (header + rows);
    numbers become ints and ``None`` becomes None."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return []
    header = [h.strip() for h in lines[0].split("\t") if h.strip()]
    rows: list[dict[str, Any]] = []
    for line in lines[1:]:
        cells = [c.strip() for c in line.split("\t")]
        row: dict[str, Any] = {}
        for name, cell in zip(header, cells, strict=False):
            if cell == "None":
                row[name] = None
            elif re.fullmatch(r"-?\d+", cell):
                row[name] = int(cell)
            else:
                row[name] = cell
        rows.append(row)
    return rows


class HangingTransactionsOperator(BaseOperator):
    """
    Runs Kafka's ``TransactionsCommand`` to find, describe or abort open transactions.

    * ``action='find-hanging'``: transactions that have been open longer than
      ``max_transaction_timeout_minutes`` and that their coordinator no longer
      knows (``--broker-id`` or ``--topic`` [``--partition``]).
    * ``action='describe-producers'``: the active producers of ``topic``/``partition``,
      including ``CurrentTransactionStartOffset`` of an open transaction.
    * ``action='abort'``: abort the transaction starting at ``start_offset`` of
      ``topic``/``partition``.

    Nothing is aborted unless ``confirm_abort=True``: without it, ``abort`` only
    describes the producers of the partition and reports what it would abort. With
    ``confirm_abort=True``, ``find-hanging`` also aborts every hanging transaction it
    finds.

    The returned XCom is a dict with ``action``, ``rows`` (the parsed table),
    ``aborted`` (list of ``{topic, partition, start_offset}``) and ``would_abort``.

    :param action: ``find-hanging``, ``describe-producers`` or ``abort``.
    :param kafka_config_id: The connection object to use, defaults to "kafka_default"
        (``bootstrap.servers`` and security settings come from its extra).
    :param topic: topic name.
    :param partition: partition number.
    :param broker_id: broker to search (``find-hanging``).
    :param start_offset: first offset of the transaction to abort (``abort``).
    :param max_transaction_timeout_minutes: ``find-hanging --max-transaction-timeout``
        (the broker's ``transaction.max.timeout.ms`` in minutes; Kafka's default 15).
    :param confirm_abort: actually abort; otherwise only report.
    :param tools_classpath: classpath with Kafka's ``kafka-tools`` jars; defaults to the
        ``EOS_KAFKA_TOOLS_CLASSPATH`` environment variable.
    :param kafka_transactions_script: path of ``kafka-transactions.sh``, used instead of
        ``java -cp`` when given.
    :param java_bin: the ``java`` executable.
    :param command_properties: extra Java admin client properties, written (with the
        translated connection security settings) to a mode-600 ``--command-config`` file.
    :param command_timeout: seconds allowed for each tool run.
    """

    template_fields: Sequence[str] = ("action", "topic", "partition", "start_offset", "broker_id")
    ui_color = "#ffd9cc"

    def __init__(
        self,
        *,
        action: str = "find-hanging",
        kafka_config_id: str = "kafka_default",
        topic: str | None = None,
        partition: int | None = None,
        broker_id: int | None = None,
        start_offset: int | None = None,
        max_transaction_timeout_minutes: int | None = None,
        confirm_abort: bool = False,
        tools_classpath: str | None = None,
        kafka_transactions_script: str | None = None,
        java_bin: str = "java",
        command_properties: dict[str, str] | None = None,
        command_timeout: float = 120.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        self.action = action
        self.kafka_config_id = kafka_config_id
        self.topic = topic
        self.partition = partition
        self.broker_id = broker_id
        self.start_offset = start_offset
        self.max_transaction_timeout_minutes = max_transaction_timeout_minutes
        self.confirm_abort = confirm_abort
        self.tools_classpath = tools_classpath
        self.kafka_transactions_script = kafka_transactions_script
        self.java_bin = java_bin
        self.command_properties = dict(command_properties or {})
        self.command_timeout = command_timeout

    # ---------------------------------------------------------------- command line
    def _base_command(self) -> list[str]:
        if self.kafka_transactions_script:
            return [self.kafka_transactions_script]
        classpath = self.tools_classpath or os.environ.get(CLASSPATH_ENV)
        if not classpath:
            raise AirflowException(
                f"No Kafka tools classpath: set tools_classpath, the {CLASSPATH_ENV} environment "
                "variable, or kafka_transactions_script."
            )
        return [self.java_bin, "-cp", classpath, TOOL_CLASS]

    def _run(self, args: list[str], config: dict[str, Any], check: bool = True) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="eos-kafka-txn-") as tmp:
            workdir = Path(tmp)
            workdir.chmod(0o700)
            cmd = [*self._base_command(), "--bootstrap-server", str(config["bootstrap.servers"])]
            props = java_client_properties(config, workdir)
            props.update(self.command_properties)
            if props:
                path = workdir / "command.properties"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as fh:
                    for key, value in props.items():
                        fh.write(f"{key}={_properties_escape(str(value))}\n")
                cmd += ["--command-config", str(path)]
            cmd += args
            self.log.info("Running %s", shlex.join(cmd))
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=self.command_timeout, check=False)
            except FileNotFoundError as err:
                raise AirflowException(f"Cannot run the Kafka TransactionsCommand ({cmd[0]}): {err}") from err
            except subprocess.TimeoutExpired as err:
                raise AirflowException(
                    f"Kafka TransactionsCommand {args[0]} did not finish within {self.command_timeout}s"
                ) from err
        if result.stdout.strip():
            self.log.info("%s output:\n%s", args[0], result.stdout.rstrip())
        if check and result.returncode != 0:
            raise AirflowException(
                f"Kafka TransactionsCommand {shlex.join(args)} failed (exit {result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-2000:]}"
            )
        return result

    def _find_hanging_args(self) -> list[str]:
        args = ["find-hanging"]
        if self.broker_id is not None:
            args += ["--broker-id", str(self.broker_id)]
        elif self.topic:
            args += ["--topic", self.topic]
            if self.partition is not None:
                args += ["--partition", str(self.partition)]
        else:
            raise AirflowException("find-hanging needs broker_id or topic")
        if self.max_transaction_timeout_minutes is not None:
            args += ["--max-transaction-timeout", str(self.max_transaction_timeout_minutes)]
        return args

    def _require_partition(self) -> tuple[str, int]:
        if not self.topic or self.partition is None:
            raise AirflowException(f"{self.action} needs topic and partition")
        return self.topic, int(self.partition)

    def _abort(self, config: dict[str, Any], topic: str, partition: int, start_offset: int) -> None:
        self.log.warning("Aborting the transaction at %s[%s] starting at offset %s", topic, partition, start_offset)
        self._run(
            ["abort", "--topic", topic, "--partition", str(partition), "--start-offset", str(start_offset)],
            config,
        )

    # ---------------------------------------------------------------- execute
    def execute(self, context: Any) -> dict[str, Any]:
        config = KafkaBaseHook(kafka_config_id=self.kafka_config_id)._build_config()
        result: dict[str, Any] = {"action": self.action, "rows": [], "aborted": [], "would_abort": []}

        if self.action == "find-hanging":
            rows = parse_table(self._run(self._find_hanging_args(), config).stdout)
            result["rows"] = rows
            targets = [
                {"topic": r["Topic"], "partition": r["Partition"], "start_offset": r["StartOffset"]} for r in rows
            ]
            if not rows:
                self.log.info("No hanging transactions found")
            elif self.confirm_abort:
                for t in targets:
                    self._abort(config, t["topic"], t["partition"], t["start_offset"])
                result["aborted"] = targets
            else:
                result["would_abort"] = targets
                self.log.warning(
                    "%d hanging transaction(s) found; not aborting them (confirm_abort=False): %s",
                    len(rows),
                    targets,
                )
            return result

        topic, partition = self._require_partition()
        describe = ["describe-producers", "--topic", topic, "--partition", str(partition)]
        if self.action == "describe-producers":
            result["rows"] = parse_table(self._run(describe, config).stdout)
            return result

        # abort
        if self.start_offset is None:
            raise AirflowException("abort needs start_offset (see describe-producers' CurrentTransactionStartOffset)")
        start_offset = int(self.start_offset)
        rows = parse_table(self._run(describe, config).stdout)
        result["rows"] = rows
        target = {"topic": topic, "partition": partition, "start_offset": start_offset}
        open_here = [r for r in rows if r.get("CurrentTransactionStartOffset") == start_offset]
        if not open_here:
            self.log.warning(
                "No producer of %s[%s] has an open transaction starting at offset %s", topic, partition, start_offset
            )
        if not self.confirm_abort:
            result["would_abort"] = [target]
            self.log.warning(
                "Not aborting the transaction at %s[%s] offset %s: confirm_abort is False "
                "(only reporting). Producers: %s",
                topic,
                partition,
                start_offset,
                rows,
            )
            return result
        self._abort(config, topic, partition, start_offset)
        result["aborted"] = [target]
        return result
