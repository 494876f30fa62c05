"""The ``kafka`` connection's extra (librdkafka's names) as options of kafka-python's
``KafkaAdminClient``, which the hanging-transactions hook uses: only the security settings
that client can honour, each refused by name otherwise, and no value in any message."""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowException

_SECURITY_PROTOCOLS = frozenset({"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"})
_PASSWORD_MECHANISMS = frozenset({"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"})
# librdkafka security settings -> kafka-python options (file paths and the key's password).
_SSL_FILES = {
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_password",
    "ssl.crl.location": "ssl_crlfile",
}
_HANDLED = frozenset(
    {
        "bootstrap.servers",
        "client.id",
        "security.protocol",
        "sasl.mechanism",
        "sasl.mechanisms",
        "sasl.username",
        "sasl.password",
        "ssl.endpoint.identification.algorithm",
        *_SSL_FILES,
    }
)


class KafkaAdminConfigError(AirflowException):
    """A security setting of the Kafka connection that the Python admin client cannot use."""


def kafka_python_config(config: dict[str, Any]) -> dict[str, Any]:
    """
    Translate a librdkafka config (a ``kafka`` connection's extra) into
    ``kafka.KafkaAdminClient`` options.

    Handled: ``bootstrap.servers``, ``client.id``, ``security.protocol`` (PLAINTEXT, SSL,
    SASL_PLAINTEXT, SASL_SSL), ``sasl.mechanism(s)`` PLAIN / SCRAM-SHA-256 / SCRAM-SHA-512
    with ``sasl.username`` and ``sasl.password``, ``ssl.ca.location``,
    ``ssl.certificate.location``, ``ssl.key.location``, ``ssl.key.password``,
    ``ssl.crl.location`` and ``ssl.endpoint.identification.algorithm`` (``https`` or ``none``).
    Settings that are not about security (``group.id``, timeouts, callbacks, ...) are ignored:
    they are librdkafka's. Any other ``security.*``, ``sasl.*`` or ``ssl.*`` setting (GSSAPI,
    OAUTHBEARER, inline PEM strings, key stores) raises :class:`KafkaAdminConfigError` naming
    the key; no value is ever put in the message.
    """
    out: dict[str, Any] = {}
    servers = config.get("bootstrap.servers")
    if not servers:
        raise KafkaAdminConfigError("The Kafka connection has no bootstrap.servers")
    out["bootstrap_servers"] = [s.strip() for s in str(servers).split(",") if s.strip()]
    if config.get("client.id"):
        out["client_id"] = str(config["client.id"])

    unknown = sorted(
        k for k in config if k not in _HANDLED and k.split(".", 1)[0] in ("security", "sasl", "ssl")
    )
    if unknown:
        raise KafkaAdminConfigError(
            f"Kafka connection setting(s) {', '.join(unknown)} are not supported by the Python admin "
            "client used to find, describe and abort hanging transactions (supported: security.protocol, "
            "sasl.mechanism PLAIN/SCRAM-SHA-256/SCRAM-SHA-512 with sasl.username and sasl.password, "
            f"{', '.join(_SSL_FILES)}, ssl.endpoint.identification.algorithm)"
        )

    protocol = str(config.get("security.protocol", "PLAINTEXT")).upper()
    if protocol not in _SECURITY_PROTOCOLS:
        raise KafkaAdminConfigError(
            f"Kafka connection setting security.protocol={protocol} is not one of "
            f"{', '.join(sorted(_SECURITY_PROTOCOLS))}"
        )
    out["security_protocol"] = protocol

    out.update(_sasl_options(config, protocol))
    out.update(_ssl_options(config, protocol))
    return out


def _sasl_options(config: dict[str, Any], protocol: str) -> dict[str, Any]:
    """The admin client's SASL options: a password mechanism with its credentials under a
    ``SASL_*`` protocol, none under another (and no SASL setting given then)."""
    out: dict[str, Any] = {}
    mechanism_key = "sasl.mechanism" if "sasl.mechanism" in config else "sasl.mechanisms"
    credentials = [k for k in ("sasl.username", "sasl.password") if k in config]
    if protocol.startswith("SASL_"):
        # librdkafka's default mechanism is GSSAPI, which this client does not do.
        mechanism = str(config.get(mechanism_key) or "GSSAPI").upper()
        if mechanism not in _PASSWORD_MECHANISMS:
            given = f"{mechanism_key}={mechanism}" if config.get(mechanism_key) else "sasl.mechanism (unset: GSSAPI)"
            raise KafkaAdminConfigError(
                f"Kafka connection setting {given} is not supported by the Python admin client "
                f"(supported with security.protocol={protocol}: {', '.join(sorted(_PASSWORD_MECHANISMS))})"
            )
        missing = [k for k in ("sasl.username", "sasl.password") if not config.get(k)]
        if missing:
            raise KafkaAdminConfigError(
                f"Kafka connection has security.protocol={protocol} with {mechanism_key}={mechanism} "
                f"but no {' or '.join(missing)}"
            )
        out["sasl_mechanism"] = mechanism
        out["sasl_plain_username"] = str(config["sasl.username"])
        out["sasl_plain_password"] = str(config["sasl.password"])
    elif credentials or config.get("sasl.mechanism") or config.get("sasl.mechanisms"):
        sasl_keys = credentials + [k for k in ("sasl.mechanism", "sasl.mechanisms") if k in config]
        raise KafkaAdminConfigError(
            f"Kafka connection setting(s) {', '.join(sasl_keys)} given, but security.protocol={protocol} "
            "does not use SASL (use SASL_PLAINTEXT or SASL_SSL)"
        )

    return out


def _ssl_options(config: dict[str, Any], protocol: str) -> dict[str, Any]:
    """The admin client's TLS options: the files and the hostname check under an ``*SSL``
    protocol, none under another (and no TLS file given then)."""
    out: dict[str, Any] = {}
    ssl_given = [k for k in _SSL_FILES if config.get(k)]
    if protocol.endswith("SSL"):
        for key in ssl_given:
            out[_SSL_FILES[key]] = str(config[key])
        if ("ssl.certificate.location" in config) != ("ssl.key.location" in config):
            raise KafkaAdminConfigError(
                "Kafka connection has only one of ssl.certificate.location and ssl.key.location "
                "(a client certificate needs both)"
            )
        algorithm = str(config.get("ssl.endpoint.identification.algorithm", "https")).lower()
        if algorithm not in ("https", "none"):
            raise KafkaAdminConfigError(
                f"Kafka connection setting ssl.endpoint.identification.algorithm={algorithm} is not https or none"
            )
        out["ssl_check_hostname"] = algorithm == "https"
    elif ssl_given:
        raise KafkaAdminConfigError(
            f"Kafka connection setting(s) {', '.join(ssl_given)} given, but security.protocol={protocol} "
            "does not use TLS (use SSL or SASL_SSL)"
        )
    return out
