"""A small client of Kafka Connect's REST API: create or update a connector, read its status,
pause, resume, restart and delete it, and judge whether it and its tasks are RUNNING."""

from __future__ import annotations

from functools import cached_property
from typing import Any
from urllib.parse import quote

import requests
from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.utils.cdc_health import DEFAULT_KAFKA_CONNECT_CONN_ID, connector_problems


class KafkaConnectError(AirflowException):
    """Connect's REST API answered with an error (its ``error_code`` and ``message``), or not at all."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.http_status = status_code


class ConnectorNotFoundError(KafkaConnectError):
    """No connector of that name on the Connect cluster (HTTP 404)."""


class ConnectorUnhealthyError(AirflowException):
    """A connector or one of its tasks is not RUNNING; the message names each and its state or trace."""


class KafkaConnectHook(BaseHook):
    """
    Talks to a Kafka Connect cluster's REST API (any worker: Connect forwards writes to its leader).

    The connection (type ``kafka_connect``) gives ``host``, ``port`` and, in ``schema``, the URL
    scheme (``http`` unless it says ``https``); a ``login`` and ``password``, when set, go as HTTP
    basic authentication. Its extra may set ``verify`` (a CA bundle path, or false) for https.

    :param kafka_connect_conn_id: The connection to use, defaults to "kafka_connect_default".
    :param timeout: seconds allowed for each request.
    """

    conn_name_attr = "kafka_connect_conn_id"
    default_conn_name = DEFAULT_KAFKA_CONNECT_CONN_ID
    conn_type = "kafka_connect"
    hook_name = "Kafka Connect"

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": [],
            "relabeling": {"schema": "Scheme (http or https)"},
            "placeholders": {"host": "localhost", "port": "8083", "schema": "http",
                             "extra": '{"verify": "/path/to/ca.pem"}'},
        }

    def __init__(self, kafka_connect_conn_id: str = default_conn_name, timeout: float = 30.0) -> None:
        super().__init__()
        self.kafka_connect_conn_id = kafka_connect_conn_id
        self.timeout = timeout

    @cached_property
    def base_url(self) -> str:
        conn = self.get_connection(self.kafka_connect_conn_id)
        host = str(conn.host or "localhost")
        if "://" in host:  # a full URL in the host field
            return host.rstrip("/")
        scheme = str(conn.schema or "http")
        return f"{scheme}://{host}:{conn.port or 8083}"

    @cached_property
    def session(self) -> requests.Session:
        conn = self.get_connection(self.kafka_connect_conn_id)
        session = requests.Session()
        if conn.login:
            session.auth = (conn.login, conn.password or "")
        verify = (conn.extra_dejson or {}).get("verify")
        if verify is not None:
            session.verify = verify
        session.headers.update({"Accept": "application/json", "Content-Type": "application/json"})
        return session

    def _request(self, method: str, path: str, json: Any = None, params: dict[str, Any] | None = None) -> Any:
        url = f"{self.base_url}{path}"
        try:
            response = self.session.request(method, url, json=json, params=params, timeout=self.timeout)
        except requests.RequestException as err:
            raise KafkaConnectError(f"Kafka Connect at {self.base_url} did not answer {method} {path}: {err}") from err
        if response.status_code >= 400:
            try:
                detail = response.json().get("message") or response.text
            except ValueError:
                detail = response.text
            error = ConnectorNotFoundError if response.status_code == 404 else KafkaConnectError
            raise error(f"Kafka Connect answered {method} {path} with {response.status_code}: {detail}",
                        response.status_code)
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    @staticmethod
    def _path(name: str, tail: str = "") -> str:
        return f"/connectors/{quote(name, safe='')}{tail}"

    # ------------------------------------------------------------------ connectors
    def list_connectors(self) -> list[str]:
        return list(self._request("GET", "/connectors"))

    def put_connector_config(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        """Creates the connector, or updates its config (``PUT /connectors/{name}/config``): the
        same call either way, so it is idempotent. Values are sent as strings, as Connect stores them."""
        body = {key: value if isinstance(value, str) else _connect_value(value) for key, value in config.items()}
        return dict(self._request("PUT", self._path(name, "/config"), json=body))

    def get_connector_config(self, name: str) -> dict[str, str]:
        return dict(self._request("GET", self._path(name, "/config")))

    def get_connector_status(self, name: str) -> dict[str, Any]:
        """``GET /connectors/{name}/status``: the connector's and each task's state, worker and trace."""
        return dict(self._request("GET", self._path(name, "/status")))

    def pause_connector(self, name: str) -> None:
        self._request("PUT", self._path(name, "/pause"))

    def resume_connector(self, name: str) -> None:
        self._request("PUT", self._path(name, "/resume"))

    def restart_connector(self, name: str, include_tasks: bool = True, only_failed: bool = False) -> Any:
        """Restarts the connector and (``include_tasks``) its tasks, or only the failed ones."""
        params = {"includeTasks": str(include_tasks).lower(), "onlyFailed": str(only_failed).lower()}
        return self._request("POST", self._path(name, "/restart"), params=params)

    def delete_connector(self, name: str, missing_ok: bool = True) -> None:
        try:
            self._request("DELETE", self._path(name))
        except ConnectorNotFoundError:
            if not missing_ok:
                raise

    # ------------------------------------------------------------------ health
    def connector_problems(self, name: str) -> list[str]:
        """What is wrong with the connector (see ``utils.cdc_health.connector_problems``); a
        connector that does not exist is one problem, naming it."""
        try:
            status = self.get_connector_status(name)
        except ConnectorNotFoundError:
            return [f"connector {name!r} does not exist on Kafka Connect at {self.base_url}"]
        return connector_problems(name, status)

    def check_connector_running(self, name: str) -> dict[str, Any]:
        """The connector's status when it and every task are RUNNING; else raises
        :class:`ConnectorUnhealthyError` naming the connector, each task and its state or trace."""
        problems = self.connector_problems(name)
        if problems:
            raise ConnectorUnhealthyError("\n".join(problems))
        return self.get_connector_status(name)

    def test_connection(self) -> tuple[bool, str]:
        try:
            info = self._request("GET", "/")
        except KafkaConnectError as err:
            return False, str(err)
        return True, f"Kafka Connect {info.get('version')} at {self.base_url}"


def _connect_value(value: Any) -> str:
    """A config value as Connect's string form: booleans lower-case, lists comma-separated."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(_connect_value(item) for item in value)
    return str(value)
