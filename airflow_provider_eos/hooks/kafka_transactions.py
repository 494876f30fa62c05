"""Kafka's ``TransactionsCommand`` (``kafka-transactions.sh``, KIP-664) as a hook: find
hanging transactions, describe a partition's producers, abort a transaction.

librdkafka (and so confluent-kafka) has no DescribeProducers, ListTransactions or
admin-abort (WriteTxnMarkers) API, so the hook runs Kafka's own tool in a subprocess.
Secrets never go on its command line: the connection's security settings are written
to a mode-600 ``--command-config`` file in a private temporary directory.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook
from airflow.sdk.exceptions import AirflowException

TOOL_CLASS = "org.apache.kafka.tools.TransactionsCommand"
CLASSPATH_ENV = "EOS_KAFKA_TOOLS_CLASSPATH"

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


def open_transaction_of(rows: list[dict[str, Any]], last_stable: int | None = None) -> dict[str, Any] | None:
    """
    The ``describe-producers`` row whose open transaction holds the partition's LSO back.

    The LSO is the first offset of the partition's oldest open transaction, so that is the
    producer whose ``CurrentTransactionStartOffset`` equals it; without ``last_stable`` (or if
    none equals it: the LSO moved since it was read) the open transaction that started first.

    :param rows: parsed ``describe-producers`` rows.
    :param last_stable: the partition's LSO, if known.
    :return: the row, or None when no producer has an open transaction.
    """
    open_rows = [r for r in rows if isinstance(r.get("CurrentTransactionStartOffset"), int)]
    if not open_rows:
        return None
    exact = [r for r in open_rows if r["CurrentTransactionStartOffset"] == last_stable]
    return (exact or sorted(open_rows, key=lambda r: r["CurrentTransactionStartOffset"]))[0]


class KafkaTransactionsHook(KafkaBaseHook):
    """
    Runs Kafka's ``TransactionsCommand`` against the cluster of a ``kafka`` connection.

    :param kafka_config_id: The connection object to use, defaults to "kafka_default"
        (``bootstrap.servers`` and security settings come from its extra).
    :param tools_classpath: classpath with Kafka's ``kafka-tools`` jars; defaults to the
        ``EOS_KAFKA_TOOLS_CLASSPATH`` environment variable.
    :param kafka_transactions_script: path of ``kafka-transactions.sh``, used instead of
        ``java -cp`` when given.
    :param java_bin: the ``java`` executable.
    :param command_properties: extra Java admin client properties, written (with the
        translated connection security settings) to a mode-600 ``--command-config`` file.
    :param command_timeout: seconds allowed for each tool run.
    """

    hook_name = "EOS Kafka transactions"

    def __init__(
        self,
        kafka_config_id: str = KafkaBaseHook.default_conn_name,
        *,
        tools_classpath: str | None = None,
        kafka_transactions_script: str | None = None,
        java_bin: str = "java",
        command_properties: dict[str, str] | None = None,
        command_timeout: float = 120.0,
    ) -> None:
        super().__init__(kafka_config_id=kafka_config_id)
        self.tools_classpath = tools_classpath
        self.kafka_transactions_script = kafka_transactions_script
        self.java_bin = java_bin
        self.command_properties = dict(command_properties or {})
        self.command_timeout = float(command_timeout)

    # ---------------------------------------------------------------- command line
    def base_command(self) -> list[str]:
        """``kafka-transactions.sh`` or ``java -cp <tools classpath> TransactionsCommand``."""
        if self.kafka_transactions_script:
            return [self.kafka_transactions_script]
        classpath = self.tools_classpath or os.environ.get(CLASSPATH_ENV)
        if not classpath:
            raise AirflowException(
                f"No Kafka tools classpath: set tools_classpath, the {CLASSPATH_ENV} environment "
                "variable, or kafka_transactions_script."
            )
        return [self.java_bin, "-cp", classpath, TOOL_CLASS]

    def run_command(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        """
        Run one ``TransactionsCommand`` sub-command.

        :param args: the sub-command and its arguments (``["describe-producers", "--topic", ...]``).
        :param check: raise ``AirflowException`` (with the tool's error) on a non-zero exit.
        """
        config = self._build_config()
        with tempfile.TemporaryDirectory(prefix="eos-kafka-txn-") as tmp:
            workdir = Path(tmp)
            workdir.chmod(0o700)
            cmd = [*self.base_command(), "--bootstrap-server", str(config["bootstrap.servers"])]
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

    # ---------------------------------------------------------------- sub-commands
    def find_hanging(
        self,
        *,
        broker_id: int | None = None,
        topic: str | None = None,
        partition: int | None = None,
        max_transaction_timeout_minutes: int | None = None,
    ) -> list[dict[str, Any]]:
        """
        ``find-hanging``: transactions open longer than ``max_transaction_timeout_minutes``
        that their coordinator no longer knows, on ``broker_id`` or ``topic`` [``partition``].
        """
        args = ["find-hanging"]
        if broker_id is not None:
            args += ["--broker-id", str(broker_id)]
        elif topic:
            args += ["--topic", topic]
            if partition is not None:
                args += ["--partition", str(partition)]
        else:
            raise AirflowException("find-hanging needs broker_id or topic")
        if max_transaction_timeout_minutes is not None:
            args += ["--max-transaction-timeout", str(max_transaction_timeout_minutes)]
        return parse_table(self.run_command(args).stdout)

    def describe_producers(self, topic: str, partition: int) -> list[dict[str, Any]]:
        """``describe-producers``: the partition's active producers (``ProducerId``,
        ``ProducerEpoch``, ``CurrentTransactionStartOffset``, ...)."""
        return parse_table(
            self.run_command(["describe-producers", "--topic", topic, "--partition", str(int(partition))]).stdout
        )

    def abort(self, topic: str, partition: int, start_offset: int) -> None:
        """``abort``: write an abort marker for the transaction starting at ``start_offset``."""
        self.log.warning("Aborting the transaction at %s[%s] starting at offset %s", topic, partition, start_offset)
        self.run_command(
            ["abort", "--topic", topic, "--partition", str(int(partition)), "--start-offset", str(int(start_offset))]
        )
