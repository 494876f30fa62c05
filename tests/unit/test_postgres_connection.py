"""One connection, three consumers: psycopg2 in the hooks, the client tools (pg_dump,
pg_restore, psql) and the Spark app all get the Airflow connection's libpq options,
and none of them gets the password anywhere but where it belongs."""

from __future__ import annotations

import json

import pytest
from psycopg2.extensions import parse_dsn

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.hooks.pg_tools import PgToolsHook
from spark_apps.eos_stream.config import ConfigError, from_dict

SECRET = "pw-9f3Kq"


@pytest.fixture
def tls_connection(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_EOS_TLS", json.dumps({
        "conn_type": "postgres", "host": "db.internal", "port": 6432, "login": "app", "password": SECRET,
        "schema": "warehouse",
        "extra": {"sslmode": "verify-full", "sslrootcert": "/etc/ssl/db-ca.pem", "cursor": "realdictcursor"}}))
    return "eos_tls"


def test_client_tools_get_every_libpq_option_and_no_password(tls_connection):
    hook = PgToolsHook(postgres_conn_id=tls_connection)
    flag, conninfo = hook._conn_args()
    assert flag == "-d"
    assert parse_dsn(conninfo) == {
        "host": "db.internal", "port": "6432", "dbname": "warehouse", "user": "app", "sslmode": "verify-full",
        "sslrootcert": "/etc/ssl/db-ca.pem", "application_name": "eos-snapshot", "connect_timeout": "10"}
    assert hook._conn_args("scratch_x")[1].count("dbname=scratch_x") == 1
    assert SECRET not in " ".join(hook._conn_args()) and hook.tool_env()["PGPASSWORD"] == SECRET


def test_the_app_target_carries_the_options_but_not_the_password(tls_connection):
    target = EosPostgresHook(postgres_conn_id=tls_connection).app_target()
    assert target == {"host": "db.internal", "port": 6432, "dbname": "warehouse", "user": "app",
                      "options": {"sslmode": "verify-full", "sslrootcert": "/etc/ssl/db-ca.pem"}}
    config = from_dict({"pipeline": "p", "topics": ["t"], "postgres": target})
    config.postgres.password = SECRET
    assert config.postgres.dsn_kwargs()["sslmode"] == "verify-full"
    assert SECRET not in config.to_json() and SECRET not in json.dumps(config.redacted())


def test_an_ssl_key_password_is_refused_for_the_app(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_EOS_KEYPW", json.dumps({
        "conn_type": "postgres", "host": "db", "extra": {"sslpassword": "k"}}))
    with pytest.raises(ValueError, match="sslpassword"):
        EosPostgresHook(postgres_conn_id="eos_keypw").app_target()
    with pytest.raises(ConfigError, match="sslpassword"):
        from_dict({"pipeline": "p", "topics": ["t"], "postgres": {"options": {"sslpassword": "k"}}})
