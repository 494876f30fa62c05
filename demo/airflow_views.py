"""What Airflow and Spark saw of the story: the target assets' events and the downstream DAG
they ran, the OpenLineage events, the standalone master's applications; and the HTML report."""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from psycopg2 import sql

from demo import report as html_report
from demo.env_files import STATE_DIR
from demo.names import (
    DOWNSTREAM,
    META,
    MIRROR_META,
    MIRROR_PIPELINE,
    ORDERS_META,
    ORDERS_PIPELINE,
    ORDERS_STREAM,
    PIPELINE,
    RECOVERY,
    STREAM,
    TOPIC,
)
from demo.story_base import StoryBase


class AirflowViews(StoryBase):
    """The story's last stage and its report."""

    def airflow_views(self, airflow_env: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
        """:returns: the ledger's asset story and the OpenLineage story, as Airflow saw them."""
        self.console.stage(f"Airflow's asset events on the ledger's targets, and the downstream DAG {DOWNSTREAM} "
                           "they ran")
        assets = self.asset_story()
        lineage = self.lineage_story(Path(json.loads(airflow_env["AIRFLOW__OPENLINEAGE__TRANSPORT"])["log_file_path"]))
        return assets, lineage

    def asset_story(self) -> dict[str, Any]:
        """What Airflow saw of the ledger's target assets in this story: the committed-offsets
        watcher's events (each with the offsets the target held everything below), the recovery's
        announcement, and the runs of the downstream DAG scheduled on them. Waits until the watcher
        has announced the final stored offsets and the downstream runs have finished."""
        stored = {str(p): int(o) for (t, p), o in self.stored_offsets(META, PIPELINE).items() if t == TOPIC}
        uris = self.api.scheduled_on(DOWNSTREAM)

        def payloads(uri: str) -> list[dict[str, Any]]:
            return [{**(e.get("extra") or {}).get("payload", {}), "from_trigger": bool(e["extra"].get("from_trigger")),
                     "timestamp": e["timestamp"]}
                    for e in self.api.asset_events(uri) if e["timestamp"] >= self.started_at]

        def final_announced() -> bool:
            watched = [p for p in payloads(uris[0]) if p["from_trigger"]] if uris else []
            return bool(watched) and watched[-1].get("offsets", {}).get(TOPIC) == stored

        self.wait_until("the watcher's event with the final offsets", final_announced, 120)
        runs = [r for r in self.api.recent_runs(DOWNSTREAM, limit=100)
                if (r.get("start_date") or "") >= self.started_at]
        self.wait_until(f"{DOWNSTREAM} runs to finish", lambda: all(
            self.api.run_state(DOWNSTREAM, r["dag_run_id"]) in ("success", "failed") for r in runs), 180)
        state_of = {r["dag_run_id"]: self.api.run_state(DOWNSTREAM, r["dag_run_id"]) for r in runs}
        states = Counter(state_of.values())
        events = payloads(uris[0])
        told = [self.api.xcom(DOWNSTREAM, run_id, "report_committed")
                for run_id, state in state_of.items() if state == "success"]
        return {
            "target_assets": uris,
            "events_per_target": {uri: len(payloads(uri)) for uri in uris},
            "changes": dict(Counter(e.get("change") for e in events)),
            "events": [{k: e.get(k) for k in ("timestamp", "change", "batch_id", "offsets", "from_trigger",
                                                "snapshot_id")} for e in events],
            "stored_offsets": {TOPIC: stored},
            "downstream_runs": dict(states),
            "downstream_told": sum(len(t or []) for t in told),
        }

    def lineage_story(self, events_file: Path) -> dict[str, Any]:
        """What the OpenLineage provider's listener wrote (its file transport) for the tasks that
        read Kafka and write or audit PostgreSQL: per job, the event types, the input and output
        datasets (namespace/name) and each dataset's data-quality assertions."""
        jobs = {f"{STREAM}.run_pipeline", f"{ORDERS_STREAM}.run_pipeline", f"{RECOVERY}.replay", f"{RECOVERY}.audit"}
        seen: dict[str, dict[str, Any]] = {}
        lines = events_file.read_text().splitlines() if events_file.exists() else []
        for line in lines:
            event = json.loads(line)
            name = (event.get("job") or {}).get("name")
            if name not in jobs or event.get("eventTime", "") < self.started_at:
                continue
            job = seen.setdefault(name, {"event_types": Counter(), "inputs": set(), "outputs": set(), "quality": {}})
            job["event_types"][event.get("eventType")] += 1
            for side in ("inputs", "outputs"):
                for dataset in event.get(side) or []:
                    job[side].add(f"{dataset['namespace']}/{dataset['name']}")
                    assertions = (dataset.get("facets") or {}).get("dataQualityAssertions")
                    if assertions:
                        job["quality"][dataset["name"]] = {a["assertion"]: a["success"]
                                                           for a in assertions["assertions"]}
        return {"events_file": str(events_file), "events_read": len(lines),
                "jobs": {name: {"event_types": dict(job["event_types"]), "inputs": sorted(job["inputs"]),
                                "outputs": sorted(job["outputs"]), "quality": job["quality"]}
                         for name, job in sorted(seen.items())}}

    def cluster_applications(self) -> list[dict[str, Any]]:
        """The applications the standalone master ran for this story (its JSON at <web UI>/json/),
        oldest first: the streams' drivers and the recovery's replay. None on local[*]."""
        if not self.spark_cluster:
            return []
        with urllib.request.urlopen(f"{self.stack['EOS_SPARK_MASTER_WEBUI']}/json/", timeout=10) as response:
            state = json.load(response)
        apps = [{key: app.get(key) for key in ("id", "name", "cores", "state", "starttime")}
                for app in state.get("activeapps", []) + state.get("completedapps", [])
                if app.get("starttime", 0) >= self.started_ms]
        return sorted(apps, key=lambda app: app["starttime"])

    def write_html(self, result: dict[str, Any], steps: list[tuple[str, float]]) -> None:
        wall_offset = time.time() - (time.monotonic() - self.sampler.started)
        throughput: dict[str, list[tuple[float, float]]] = {}
        for pipeline, meta in ((PIPELINE, META), (ORDERS_PIPELINE, ORDERS_META), (MIRROR_PIPELINE, MIRROR_META)):
            rows = self.query(sql.SQL(
                "SELECT extract(epoch FROM recorded_at), input_rows, batch_duration_ms FROM {}.stream_progress"
                " WHERE pipeline = %s ORDER BY recorded_at").format(sql.Identifier(meta)), (pipeline,))
            throughput[f"{pipeline} rows/s"] = [(float(t) - wall_offset, rows_ / max(ms or 1, 1) * 1000)
                                                for t, rows_, ms in rows if rows_]
        orders = dict(result["orders"])
        orders.update({f"through the ledger's recovery: {k}": v
                       for k, v in orders.pop("through_the_ledger_recovery").items()})
        page = html_report.render({
            "exact": result["exact"],
            "summary": {k: v for k, v in result.items()
                        if k not in ("recovery_steps_s", "orders", "mirror", "spark", "assets", "lineage")},
            "orders": orders,
            "mirror": result["mirror"],
            "spark": {"master": result["spark"]["master"],
                      **{app["id"]: f"{app['name']} ({app['cores']} core(s), {app['state']})"
                         for app in result["spark"]["applications"]}},
            "runs": self.runs,
            "lso_lag": self.sampler.samples,
            "throughput": throughput,
            "recovery_steps": steps,
        })
        out = STATE_DIR / "demo" / "report.html"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page)
        self.report_path = out
