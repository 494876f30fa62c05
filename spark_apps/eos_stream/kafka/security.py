"""Kafka credentials in one spelling: librdkafka's, as an Airflow ``kafka`` connection's extra
holds them; the Java client's options (Spark's Kafka source) are derived from them here.

Why librdkafka's names are the source: the connection is the one place a platform team keeps
credentials, Airflow's Kafka provider passes its extra to confluent-kafka unchanged, and the
health check, the abort, the audit and the Spark-less replay all use librdkafka. Only Spark's
Kafka source speaks Java, so only it needs a translation, and that translation is mechanical:

=================================  ==================================================
librdkafka (connection extra)      Java client (``kafka.`` options of the Spark source)
=================================  ==================================================
``security.protocol``              ``security.protocol``
``sasl.mechanism(s)``              ``sasl.mechanism``
``sasl.username``/``password``     ``sasl.jaas.config`` (PLAIN or SCRAM login module)
``sasl.oauthbearer.method: oidc``  ``sasl.jaas.config`` (OAuthBearer login module with
 + client id/secret, scope,         clientId, clientSecret, scope),
 ``token.endpoint.url``             ``sasl.oauthbearer.token.endpoint.url`` and the
                                    login callback handler
``ssl.ca.location``                ``ssl.truststore.location`` + ``type PEM``
``ssl.certificate.location``       ``ssl.keystore.certificate.chain`` + ``ssl.keystore.key``
 + ``ssl.key.location``             (the PEM files' contents) + ``type PEM``
``ssl.key.password``               ``ssl.key.password``
``ssl.endpoint.identification.``   same name
``algorithm``
=================================  ==================================================

A security option with no Java equivalent here (Kerberos, a librdkafka-only callback, AWS
IAM's own login module) is refused with its name rather than dropped, so a pipeline never
connects with weaker security than its connection asks for. Options outside
``security.``/``sasl.``/``ssl.`` (consumer tuning) go to the Java client unchanged; most
consumer names are the same in both clients.

Values may be secrets: nothing here logs them, and callers keep the result off command lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

SECURITY_PREFIXES = ("security.", "sasl.", "ssl.")
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
_OAUTH_MODULE = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
_OAUTH_HANDLER = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginCallbackHandler"
# librdkafka names this module reads; any other security option is refused.
_UNDERSTOOD = frozenset({
    "security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username", "sasl.password",
    "sasl.oauthbearer.method", "sasl.oauthbearer.client.id", "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.scope", "sasl.oauthbearer.token.endpoint.url", "ssl.ca.location",
    "ssl.certificate.location", "ssl.key.location", "ssl.key.password",
    "ssl.endpoint.identification.algorithm",
})


class KafkaSecurityError(ValueError):
    """The connection's security options cannot be given to the Java client as they are."""


def security_options(options: Mapping[str, object]) -> dict[str, str]:
    """The security part of librdkafka options: what the driver's own clients need too."""
    return {k: str(v) for k, v in options.items() if k.startswith(SECURITY_PREFIXES)}


def executor_options(options: Mapping[str, object]) -> dict[str, str]:
    """The security options (librdkafka names) for the executors' own range readers
    (``kafka_ranges``): the client certificate and key travel as their PEM texts, as they do
    to Spark's Java source, because an executor on another host has no copy of the driver's
    files. ``ssl.ca.location`` stays a path on both, as the Java trust store's does.

    :raises KafkaSecurityError: a PEM file it names cannot be read.
    """
    security = security_options(options)
    for option, inline in (("ssl.certificate.location", "ssl.certificate.pem"), ("ssl.key.location", "ssl.key.pem")):
        path = security.pop(option, None)
        if path:
            security[inline] = _read_pem(path, option)
    return security


def java_options(options: Mapping[str, object]) -> dict[str, str]:
    """Java client options (without Spark's ``kafka.`` prefix) for librdkafka ``options``.

    :raises KafkaSecurityError: an option or a combination has no Java equivalent here, or a
        PEM file it names cannot be read.
    """
    security = security_options(options)
    unknown = sorted(set(security) - _UNDERSTOOD)
    if unknown:
        raise KafkaSecurityError(
            f"Kafka security option(s) {', '.join(unknown)} have no Java client equivalent in this "
            f"provider; supported: {', '.join(sorted(_UNDERSTOOD))}")
    java = {k: str(v) for k, v in options.items() if not k.startswith(SECURITY_PREFIXES)}
    protocol = security.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise KafkaSecurityError(f"security.protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    java["security.protocol"] = protocol
    if protocol.startswith("SASL_"):
        java.update(_sasl(security))
    if protocol.endswith("SSL"):
        java.update(_ssl(security))
    return java


def _sasl(security: Mapping[str, str]) -> dict[str, str]:
    mechanism = (security.get("sasl.mechanism") or security.get("sasl.mechanisms") or "GSSAPI").upper()
    if mechanism in _LOGIN_MODULES:
        missing = [k for k in ("sasl.username", "sasl.password") if not security.get(k)]
        if missing:
            raise KafkaSecurityError(f"SASL {mechanism} needs {' and '.join(missing)}")
        jaas = _jaas(_LOGIN_MODULES[mechanism], username=security["sasl.username"],
                     password=security["sasl.password"])
        return {"sasl.mechanism": mechanism, "sasl.jaas.config": jaas}
    if mechanism == "OAUTHBEARER":
        if security.get("sasl.oauthbearer.method", "default").lower() != "oidc":
            raise KafkaSecurityError(
                "SASL OAUTHBEARER needs sasl.oauthbearer.method 'oidc' (client credentials): librdkafka's "
                "default method relies on a token callback in the client's own process")
        url = security.get("sasl.oauthbearer.token.endpoint.url")
        if not url:
            raise KafkaSecurityError("SASL OAUTHBEARER (oidc) needs sasl.oauthbearer.token.endpoint.url")
        fields = {"clientId": security.get("sasl.oauthbearer.client.id", ""),
                  "clientSecret": security.get("sasl.oauthbearer.client.secret", "")}
        if security.get("sasl.oauthbearer.scope"):
            fields["scope"] = security["sasl.oauthbearer.scope"]
        return {"sasl.mechanism": mechanism, "sasl.jaas.config": _jaas(_OAUTH_MODULE, **fields),
                "sasl.oauthbearer.token.endpoint.url": url, "sasl.login.callback.handler.class": _OAUTH_HANDLER}
    raise KafkaSecurityError(
        f"SASL mechanism {mechanism} is not supported by this provider's Java translation "
        f"(supported: {', '.join([*_LOGIN_MODULES, 'OAUTHBEARER'])})")


def _ssl(security: Mapping[str, str]) -> dict[str, str]:
    java: dict[str, str] = {}
    if security.get("ssl.ca.location"):
        java["ssl.truststore.type"] = "PEM"
        java["ssl.truststore.location"] = security["ssl.ca.location"]
    cert, key = security.get("ssl.certificate.location"), security.get("ssl.key.location")
    if bool(cert) != bool(key):
        raise KafkaSecurityError("mutual TLS needs both ssl.certificate.location and ssl.key.location")
    if cert and key:
        # The Java client takes a PEM key store as a file holding key and chain together, or as
        # the two PEM texts; the texts need no file written beside the caller's.
        java["ssl.keystore.type"] = "PEM"
        java["ssl.keystore.certificate.chain"] = _read_pem(cert, "ssl.certificate.location")
        java["ssl.keystore.key"] = _read_pem(key, "ssl.key.location")
    if security.get("ssl.key.password"):
        java["ssl.key.password"] = security["ssl.key.password"]
    if "ssl.endpoint.identification.algorithm" in security:
        java["ssl.endpoint.identification.algorithm"] = security["ssl.endpoint.identification.algorithm"]
    return java


def _read_pem(path: str, option: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise KafkaSecurityError(f"cannot read {option} {path}: {exc.strerror}") from None


def _jaas(module: str, **fields: str) -> str:
    """A JAAS line; values are quoted with ``"`` and ``\\`` escaped, so no value can end its
    quote and add options of its own."""
    quoted = " ".join(f'{name}="{_escape(value)}"' for name, value in fields.items())
    return f"{module} required {quoted};"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')
