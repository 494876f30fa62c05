"""The Java client's options derived from a Kafka connection's librdkafka options."""

from __future__ import annotations

import pytest

from spark_apps.eos_stream.kafka.security import KafkaSecurityError, executor_options, java_options, security_options

SCRAM = {"security.protocol": "sasl_plaintext", "sasl.mechanism": "SCRAM-SHA-512",
         "sasl.username": "eos", "sasl.password": 'p"a\\ss'}


def test_scram_becomes_a_jaas_line_with_the_values_quoted() -> None:
    java = java_options(SCRAM)
    assert java["security.protocol"] == "SASL_PLAINTEXT"
    assert java["sasl.mechanism"] == "SCRAM-SHA-512"
    # A quote or backslash in the password cannot end the quoted value and add options.
    assert java["sasl.jaas.config"] == (
        'org.apache.kafka.common.security.scram.ScramLoginModule required username="eos" password="p\\"a\\\\ss";')
    assert not {"sasl.username", "sasl.password"} & set(java)


def test_plain_and_the_plural_mechanism_key() -> None:
    java = java_options({**SCRAM, "sasl.mechanism": "PLAIN"})
    assert java["sasl.jaas.config"].startswith("org.apache.kafka.common.security.plain.PlainLoginModule required")
    plural = {k: v for k, v in SCRAM.items() if k != "sasl.mechanism"} | {"sasl.mechanisms": "PLAIN"}
    assert java_options(plural)["sasl.mechanism"] == "PLAIN"


def test_plaintext_and_tuning_options_pass_through() -> None:
    assert java_options({}) == {"security.protocol": "PLAINTEXT"}
    assert java_options({"fetch.max.bytes": 1024})["fetch.max.bytes"] == "1024"


def test_ssl_files(tmp_path) -> None:
    (tmp_path / "c.pem").write_text("CERT")
    (tmp_path / "k.pem").write_text("KEY")
    java = java_options({"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "u",
                         "sasl.password": "p", "ssl.ca.location": "/ca.pem",
                         "ssl.certificate.location": str(tmp_path / "c.pem"),
                         "ssl.key.location": str(tmp_path / "k.pem"), "ssl.key.password": "kp",
                         "ssl.endpoint.identification.algorithm": "none"})
    assert java["ssl.truststore.type"] == "PEM" and java["ssl.truststore.location"] == "/ca.pem"
    assert (java["ssl.keystore.type"], java["ssl.keystore.certificate.chain"], java["ssl.keystore.key"]) == (
        "PEM", "CERT", "KEY")
    assert java["ssl.key.password"] == "kp" and java["ssl.endpoint.identification.algorithm"] == "none"
    # SASL_PLAINTEXT takes no TLS settings, SSL no SASL ones.
    assert "ssl.truststore.location" not in java_options({**SCRAM, "ssl.ca.location": "/ca.pem"})
    assert "sasl.jaas.config" not in java_options({"security.protocol": "SSL", "ssl.ca.location": "/ca.pem"})


def test_oidc() -> None:
    java = java_options({"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER",
                         "sasl.oauthbearer.method": "oidc", "sasl.oauthbearer.client.id": "id",
                         "sasl.oauthbearer.client.secret": "s", "sasl.oauthbearer.scope": "kafka",
                         "sasl.oauthbearer.token.endpoint.url": "https://idp/token"})
    assert java["sasl.jaas.config"] == ('org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule '
                                        'required clientId="id" clientSecret="s" scope="kafka";')
    assert java["sasl.oauthbearer.token.endpoint.url"] == "https://idp/token"
    assert java["sasl.login.callback.handler.class"].endswith("OAuthBearerLoginCallbackHandler")


@pytest.mark.parametrize(("options", "message"), [
    ({**SCRAM, "sasl.kerberos.service.name": "kafka"}, "sasl.kerberos.service.name"),
    ({"security.protocol": "SASL_PLAINTEXT"}, "GSSAPI"),
    ({**SCRAM, "sasl.password": ""}, "needs sasl.password"),
    ({"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"}, "oidc"),
    ({"security.protocol": "SSL", "ssl.certificate.location": "/c.pem"}, "both"),
    ({"security.protocol": "SSL", "ssl.certificate.location": "/nope.pem", "ssl.key.location": "/nope"},
     "cannot read ssl.certificate.location"),
    ({"security.protocol": "TLS"}, "not one of"),
])
def test_what_has_no_java_equivalent_is_refused_by_name(options, message) -> None:
    with pytest.raises(KafkaSecurityError, match=message):
        java_options(options)


def test_errors_never_show_a_secret() -> None:
    with pytest.raises(KafkaSecurityError) as caught:
        java_options({**SCRAM, "sasl.mechanism": "GSSAPI"})
    assert SCRAM["sasl.password"] not in str(caught.value)


def test_security_options_are_the_librdkafka_part() -> None:
    assert security_options({**SCRAM, "fetch.max.bytes": 1}) == SCRAM


def test_executors_get_the_client_certificate_and_key_as_pem_text(tmp_path) -> None:
    (tmp_path / "c.pem").write_text("CERT")
    (tmp_path / "k.pem").write_text("KEY")
    options = {"security.protocol": "SSL", "ssl.ca.location": "/etc/ca.pem", "ssl.key.password": "kp",
               "ssl.certificate.location": str(tmp_path / "c.pem"), "ssl.key.location": str(tmp_path / "k.pem"),
               "client.id": "not security"}
    # A worker on another host has no copy of the driver's files; the trust store stays a path, as for Java.
    assert executor_options(options) == {"security.protocol": "SSL", "ssl.ca.location": "/etc/ca.pem",
                                            "ssl.key.password": "kp", "ssl.certificate.pem": "CERT",
                                            "ssl.key.pem": "KEY"}
    with pytest.raises(KafkaSecurityError, match=r"ssl\.key\.location"):
        executor_options({**options, "ssl.key.location": str(tmp_path / "missing.pem")})
