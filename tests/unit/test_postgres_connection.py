"""One connection, three consumers: psycopg2 in the hooks, the client tools (pg_dump,
pg_restore, psql) and the Spark app all get the Airflow connection's libpq options,
and none of them gets the password anywhere but where it belongs."""

from __future__ import annotations

import json

import pytest
from psycopg2.extensions import parse_dsn

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.hooks.pg_tools import PgToolsHook
from airflow_provider_eos.recovery.lock import acquire_lock, release_lock
from airflow_provider_eos.state.activity import stream_activity
from airflow_provider_eos.state.stop_requests import set_stop_request
from spark_apps.eos_stream.run.config import ConfigError, from_dict

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
        "sslrootcert": "/etc/ssl/db-ca.pem", "application_name": "eos-snapshot", "connect_timeout": "10",
        "keepalives": "1", "keepalives_idle": "30", "keepalives_interval": "10", "keepalives_count": "3",
        "options": "-c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 -c tcp_keepalives_count=3"}
    assert hook._conn_args("scratch_x")[1].count("dbname=scratch_x") == 1
    assert SECRET not in " ".join(hook._conn_args()) and hook.tool_env()["PGPASSWORD"] == SECRET


def test_the_app_target_carries_the_options_but_not_the_password(tls_connection):
    target = EosPostgresHook(postgres_conn_id=tls_connection).app_target()
    assert target == {"host": "db.internal", "port": 6432, "dbname": "warehouse", "user": "app",
                      "options": {"sslmode": "verify-full", "sslrootcert": "/etc/ssl/db-ca.pem"}}
    config = from_dict({"pipeline": "p", "topics": ["t"], "spec": "m:S", "postgres": target})
    config.postgres.password = SECRET
    assert config.postgres.dsn_kwargs()["sslmode"] == "verify-full"
    assert SECRET not in config.to_json() and SECRET not in json.dumps(config.redacted())


def test_an_ssl_key_password_is_refused_for_the_app(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_EOS_KEYPW", json.dumps({
        "conn_type": "postgres", "host": "db", "extra": {"sslpassword": "k"}}))
    with pytest.raises(ValueError, match="sslpassword"):
        EosPostgresHook(postgres_conn_id="eos_keypw").app_target()
    with pytest.raises(ConfigError, match="sslpassword"):
        from_dict({"pipeline": "p", "topics": ["t"], "spec": "m:S", "postgres": {"options": {"sslpassword": "k"}}})


def test_every_session_sets_tcp_keepalives_and_the_connection_may_override_them(tls_connection, monkeypatch):
    """A vanished host's advisory locks end with its sessions: keepalives on the provider's
    sessions, the client tools' conninfo and the app's (driver and executors alike)."""
    from spark_apps.eos_stream.sink.postgres import TCP_KEEPALIVES, with_keepalives

    assert TCP_KEEPALIVES == {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
                              "keepalives_count": 3}
    hook = EosPostgresHook(postgres_conn_id=tls_connection)
    assert TCP_KEEPALIVES.items() <= hook.libpq_params().items()
    assert TCP_KEEPALIVES.items() <= hook.libpq_params(include_password=True).items()
    # The app sets the same defaults itself: they are not copied into its config.
    assert not set(TCP_KEEPALIVES) & set(hook.app_target()["options"])
    config = from_dict({"pipeline": "p", "topics": ["t"], "spec": "m:S", "postgres": hook.app_target()})
    assert TCP_KEEPALIVES.items() <= config.postgres.dsn_kwargs().items()
    assert with_keepalives({"keepalives_idle": 5})["keepalives_idle"] == 5

    monkeypatch.setenv("AIRFLOW_CONN_EOS_OWN_KEEPALIVES", json.dumps({
        "conn_type": "postgres", "host": "db", "extra": {"keepalives_idle": 7, "keepalives_count": 9}}))
    own = EosPostgresHook(postgres_conn_id="eos_own_keepalives")
    server = "-c tcp_keepalives_idle=7 -c tcp_keepalives_interval=10 -c tcp_keepalives_count=9"
    assert own.libpq_params()["keepalives_idle"] == 7 and own.libpq_params()["keepalives_count"] == 9
    assert own.libpq_params()["options"] == server  # the server probes with the same numbers
    assert own.app_target()["options"] == {"keepalives_idle": 7, "keepalives_count": 9}
    app = from_dict({"pipeline": "p", "topics": ["t"], "spec": "m:S",
                     "postgres": own.app_target()}).postgres.dsn_kwargs()
    assert (app["keepalives_idle"], app["keepalives_count"], app["keepalives_interval"]) == (7, 9, 10)
    assert app["options"] == server and with_keepalives(app) == app  # idempotent
    # The connection's own startup options stay, after ours (a -c of its own wins); keepalives=0 is off.
    assert with_keepalives({"options": "-c search_path=x"})["options"] == (
        "-c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 -c tcp_keepalives_count=3 -c search_path=x")
    assert "options" not in with_keepalives({"keepalives": 0})


def test_the_client_tools_get_sslpassword_from_a_private_service_file_not_argv(monkeypatch):
    import os
    import stat

    monkeypatch.setenv("AIRFLOW_CONN_EOS_KEYPW", json.dumps({
        "conn_type": "postgres", "host": "db", "login": "app", "password": SECRET,
        "extra": {"sslmode": "verify-full", "sslpassword": "keypw-7Qx"}}))
    hook = PgToolsHook(postgres_conn_id="eos_keypw")
    _, conninfo = hook._conn_args()
    assert "keypw-7Qx" not in conninfo and SECRET not in conninfo
    assert parse_dsn(conninfo)["service"] == "eos" and parse_dsn(conninfo)["sslmode"] == "verify-full"
    env = hook.tool_env()
    service_file = env["PGSERVICEFILE"]
    assert stat.S_IMODE(os.stat(service_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(service_file)).st_mode) == 0o700
    with open(service_file) as handle:
        assert handle.read() == "[eos]\nsslpassword=keypw-7Qx\n"


def test_keepalive_options_keep_what_pgoptions_asked_for(monkeypatch) -> None:
    """libpq reads PGOPTIONS only when no ``options`` keyword is given, and the keepalives set one:
    the environment's settings (a deployment's lock_timeout) must still reach the session."""
    from spark_apps.eos_stream.sink.postgres import with_keepalives

    monkeypatch.setenv("PGOPTIONS", "-c lock_timeout=1000")
    options = with_keepalives({"host": "db"})["options"]
    assert "-c tcp_keepalives_idle=30" in options and options.endswith("-c lock_timeout=1000")
    own = with_keepalives({"host": "db", "options": "-c statement_timeout=5s"})["options"]
    assert "lock_timeout" not in own and own.endswith("-c statement_timeout=5s")  # libpq's rule: its own win


def test_a_hook_binds_its_meta_schema_once_and_never_guesses_one(tls_connection):
    """Built without a meta schema, a hook refuses the bookkeeping (it used to read schema
    'eos' silently); built with one, no method takes it again. Refused before connecting."""
    unbound = EosPostgresHook(postgres_conn_id=tls_connection)
    for call in (lambda: set_stop_request(unbound, "p", True), lambda: stream_activity(unbound, "p"),
                 lambda: acquire_lock(unbound, "k", "run", 60.0), lambda: release_lock(unbound, "k", "run")):
        with pytest.raises(ValueError, match="built without a meta_schema"):
            call()
    assert PgToolsHook(postgres_conn_id=tls_connection, meta_schema="m_orders").meta_schema == "m_orders"


def test_a_pipeline_step_builds_its_hook_for_the_pipelines_meta_schema(tmp_path):
    from airflow_provider_eos.operators.restore import FenceOperator

    config = tmp_path / "orders.json"
    config.write_text(json.dumps({"pipeline": "orders", "topics": ["t"], "spec": "spark_apps.ledger.spec:LEDGER",
                                  "meta_schema": "m_orders"}))
    assert FenceOperator(task_id="fence", pipeline_config=str(config)).hook.meta_schema == "m_orders"


def test_threads_of_one_hook_share_one_service_file_that_stays(monkeypatch):
    """A restore proves an unproven dump in a scratch database in one thread while it swaps in another, both
    through one hook. Each thread used to make a directory when it found none: the second one
    replaced the first, whose directory (and the file a pg_restore was about to read) went with
    its object (CI: 'service file ... not found')."""
    import gc
    import os
    import threading

    monkeypatch.setenv("AIRFLOW_CONN_EOS_KEYPW", json.dumps({
        "conn_type": "postgres", "host": "db", "login": "app", "password": SECRET,
        "extra": {"sslmode": "verify-full", "sslpassword": "keypw-7Qx"}}))
    for _round in range(20):
        hook = PgToolsHook(postgres_conn_id="eos_keypw")
        start = threading.Barrier(8)
        paths: list[str] = []

        def service_file(hook: PgToolsHook, start: threading.Barrier, paths: list[str]) -> None:
            start.wait()
            paths.append(hook.tool_env()["PGSERVICEFILE"])

        threads = [threading.Thread(target=service_file, args=(hook, start, paths)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        gc.collect()  # what drops a replaced directory
        assert len(set(paths)) == 1, paths
        with open(paths[0]) as handle:
            assert handle.read() == "[eos]\nsslpassword=keypw-7Qx\n"
        assert os.listdir(os.path.dirname(paths[0])) == ["pg_service.conf"]
