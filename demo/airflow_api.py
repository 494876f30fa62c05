"""A small client of Airflow 3's public REST API (``/api/v2``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import requests

FINISHED = {"success", "failed"}


class AirflowApi:
    """:param base_url: e.g. http://127.0.0.1:18080
    :param username: / :param password: the login of Airflow's simple auth manager."""

    def __init__(self, base_url: str, username: str, password: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.session = requests.Session()
        response = requests.post(f"{self.base_url}/auth/token", json={"username": username, "password": password},
                                 timeout=30)
        response.raise_for_status()
        self.session.headers["Authorization"] = f"Bearer {response.json()['access_token']}"

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.session.request(method, f"{self.base_url}/api/v2{path}", timeout=60, **kwargs)
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path} -> {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else None

    def wait_for_dags(self, dag_ids: list[str], timeout: float = 180) -> None:
        """Waits until the dag-processor has parsed every DAG."""
        deadline = time.monotonic() + timeout
        while True:
            known = {d["dag_id"] for d in self._call("GET", "/dags", params={"limit": 100})["dags"]}
            if set(dag_ids) <= known:
                return
            if time.monotonic() > deadline:
                errors = self._call("GET", "/importErrors")
                raise RuntimeError(f"DAGs not parsed: {sorted(set(dag_ids) - known)}; import errors: {errors}")
            time.sleep(2)

    def unpause(self, dag_id: str) -> None:
        self._call("PATCH", f"/dags/{dag_id}", json={"is_paused": False})

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        body = {"logical_date": None, "conf": conf or {}}
        return self._call("POST", f"/dags/{dag_id}/dagRuns", json=body)["dag_run_id"]

    def recent_runs(self, dag_id: str, limit: int = 20) -> list[dict[str, Any]]:
        """The newest runs of a DAG, newest first."""
        params = {"limit": limit, "order_by": "-start_date"}
        return self._call("GET", f"/dags/{dag_id}/dagRuns", params=params)["dag_runs"]

    def end_unfinished_runs(self, dag_id: str) -> list[str]:
        """Marks every queued or running run of ``dag_id`` failed (Airflow then ends its running
        tasks, whose operators stop what they started); returns their ids."""
        ended = []
        for state in ("queued", "running"):
            runs = self._call("GET", f"/dags/{dag_id}/dagRuns", params={"state": state, "limit": 100})["dag_runs"]
            for run in runs:
                self._call("PATCH", f"/dags/{dag_id}/dagRuns/{run['dag_run_id']}", json={"state": "failed"})
                ended.append(run["dag_run_id"])
        return ended

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        """One DAG run: state, start_date, end_date..."""
        return self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}")

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.run(dag_id, run_id)["state"]

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]

    def deferred_tasks(self, dag_id: str) -> list[dict[str, Any]]:
        """Task instances of any run of ``dag_id`` deferred right now (``~``: every run)."""
        return self._call("GET", f"/dags/{dag_id}/dagRuns/~/taskInstances",
                          params={"state": "deferred"})["task_instances"]

    def task_tries(self, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/tries")["task_instances"]

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> list[str]:
        """One try's log, a line per event ("<level> <event>", an exception's text after it)."""
        path = f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}"
        content = self._call("GET", path, params={"full_content": True},
                             headers={"Accept": "application/json"})["content"]
        lines = []
        for entry in content:
            if isinstance(entry, str):
                lines.append(entry)
                continue
            lines.append(f"{entry.get('level', '')} {entry.get('event', '')}".strip())
            for error in entry.get("error_detail") or []:  # the task's exception, one dict per chained one
                lines.append(f"  {error.get('exc_type')}: {error.get('exc_value')}" if isinstance(error, dict)
                             else f"  {error}")
        return lines

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        path = f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}"
        return self._call("GET", path, params={"deserialize": True})["value"]

    def extra_links(self, dag_id: str, run_id: str, task_id: str) -> dict[str, str | None]:
        """A task's operator extra links (name -> URL), as the UI shows them."""
        return self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/links")["extra_links"]

    def scheduled_on(self, dag_id: str) -> list[str]:
        """The URIs of the assets a DAG is scheduled on."""
        assets = self._call("GET", "/assets", params={"dag_ids": dag_id, "limit": 100})["assets"]
        return sorted(a["uri"] for a in assets if any(r.get("dag_id") == dag_id for r in a.get("scheduled_dags", [])))

    def asset_events(self, uri: str) -> list[dict[str, Any]]:
        """The newest (at most 100) events of the asset with this URI, oldest first."""
        assets = self._call("GET", "/assets", params={"uri_pattern": uri, "limit": 100})["assets"]
        ids = [a["id"] for a in assets if a["uri"] == uri]
        if not ids:
            return []
        params = {"asset_id": ids[0], "limit": 100, "order_by": "-timestamp"}
        return list(reversed(self._call("GET", "/assets/events", params=params)["asset_events"]))

    def wait(self, dag_id: str, run_id: str, timeout: float, tick: Callable[[float], None] | None = None) -> str:
        """Polls until the run finishes; ``tick`` gets the elapsed seconds (for a progress bar)."""
        started = time.monotonic()
        while True:
            state = self.run_state(dag_id, run_id)
            if state in FINISHED:
                return state
            elapsed = time.monotonic() - started
            if elapsed > timeout:
                raise TimeoutError(f"{dag_id} run {run_id} still {state} after {timeout:.0f}s")
            if tick:
                tick(elapsed)
            time.sleep(2)
