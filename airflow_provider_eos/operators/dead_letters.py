"""Health checks of a pipeline: new dead letters, in-doubt prepared transactions, and the
summary task that collects every check of a health-check DAG run into one readable verdict.

Each check records its outcome as the XCom ``eos_check`` (``{"check", "ok", "message", "report"}``)
before it succeeds or fails, so a summary task with ``trigger_rule="all_done"`` can read why
an upstream check failed, and what it measured (the summary sends that as metrics).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Variable
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.metrics.scheme import health_metrics
from airflow_provider_eos.metrics.sender import emit
from airflow_provider_eos.operators.base import CHECK_XCOM_KEY, CheckOutcomeMixin
from airflow_provider_eos.state.dead_letters import dead_letters_since
from airflow_provider_eos.state.prepared_transactions import prepared_transactions


def _variable_key(meta_schema: str, pipeline: str) -> str:
    return f"eos_dead_letters_seen__{meta_schema}__{pipeline}"


class DeadLetterCheckOperator(CheckOutcomeMixin, BaseOperator):
    """
    Fails, with each record's Kafka coordinates and error, when dead letters appeared since the
    last check. The last seen dead-letter id is kept in the Airflow Variable
    ``eos_dead_letters_seen__<meta_schema>__<pipeline>`` (or ``variable_key``) and advanced even
    when the check fails, so each dead letter alarms once. The first check reports every
    dead letter already there.

    :param pipeline: pipeline name.
    :param postgres_conn_id: target database connection, default "eos_postgres".
    :param meta_schema: schema of the bookkeeping tables.
    :param variable_key: Variable holding the last seen id.
    :param max_listed: dead letters listed in the failure message.
    :return: (XCom) ``{"new": n, "last_seen_id": id, "dead_letters": [...]}``
    """

    template_fields: Sequence[str] = ("pipeline", "meta_schema", "postgres_conn_id", "variable_key")
    check_name = "dead_letters"

    def __init__(self, *, pipeline: str, postgres_conn_id: str = "eos_postgres", meta_schema: str = "eos",
                 variable_key: str | None = None, max_listed: int = 20, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.postgres_conn_id = postgres_conn_id
        self.meta_schema = meta_schema
        self.variable_key = variable_key
        self.max_listed = max_listed

    def execute(self, context: Any) -> Any:
        return self._recorded(context, self._check)

    def _check(self) -> dict[str, Any]:
        hook = EosPostgresHook(postgres_conn_id=self.postgres_conn_id, meta_schema=self.meta_schema)
        key = self.variable_key or _variable_key(self.meta_schema, self.pipeline)
        last_seen = int(Variable.get(key, default=0) or 0)
        new = dead_letters_since(hook, self.pipeline, after_id=last_seen, limit=1000)
        if not new:
            message = f"no new dead letters for pipeline {self.pipeline!r} since id {last_seen}"
            self.log.info("%s", message)
            return {"new": 0, "last_seen_id": last_seen, "dead_letters": [], "message": message}
        newest = max(int(row["id"]) for row in new)
        Variable.set(key, str(newest))
        self.last_report = {"new": len(new), "last_seen_id": newest}
        lines = [f"{len(new)}{'+' if len(new) == 1000 else ''} new dead letter(s) for pipeline "
                 f"{self.pipeline!r} (ids {new[0]['id']}..{newest}):"]
        lines += [f"  {r['topic']}[{r['partition']}]@{r['offset']} (id {r['id']}, key {r['key_preview']!r}): "
                  f"{str(r['error'])[:300]}" for r in new[: self.max_listed]]
        if len(new) > self.max_listed:
            lines.append(f"  ... and {len(new) - self.max_listed} more in {self.meta_schema}.dead_letters")
        raise AirflowException("\n".join(lines))


class PreparedTransactionsCheckOperator(CheckOutcomeMixin, BaseOperator):
    """
    Fails when the target database holds in-doubt two-phase transactions (``pg_prepared_xacts``)
    older than ``older_than_seconds``: they keep their locks (and block vacuum) until someone
    runs ``COMMIT PREPARED`` or ``ROLLBACK PREPARED``.

    :param postgres_conn_id: target database connection, default "eos_postgres".
    :param older_than_seconds: ignore transactions prepared more recently (a commit in flight).
    :param all_databases: also report other databases of the cluster.
    """

    template_fields: Sequence[str] = ("postgres_conn_id", "older_than_seconds")
    check_name = "prepared_transactions"

    def __init__(self, *, postgres_conn_id: str = "eos_postgres", older_than_seconds: float | str = 60,
                 all_databases: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.postgres_conn_id = postgres_conn_id
        self.older_than_seconds = older_than_seconds
        self.all_databases = all_databases

    def execute(self, context: Any) -> Any:
        return self._recorded(context, self._check)

    def _check(self) -> dict[str, Any]:
        hook = EosPostgresHook(postgres_conn_id=self.postgres_conn_id)
        older = float(self.older_than_seconds)
        rows = prepared_transactions(hook, older, self.all_databases)
        if not rows:
            return {"in_doubt": [], "count": 0, "oldest_seconds": 0.0,
                    "message": f"no prepared transaction older than {older:g}s"}
        self.last_report = {"in_doubt": rows[:20], "count": len(rows),
                            "oldest_seconds": max(float(r["age_seconds"]) for r in rows)}
        lines = [f"{len(rows)} in-doubt prepared transaction(s) older than {older:g}s "
                 "(resolve with COMMIT PREPARED / ROLLBACK PREPARED '<gid>'):"]
        lines += [f"  gid {r['gid']!r} in {r['database']} by {r['owner']}, prepared {r['prepared']} "
                  f"({r['age_seconds']:.0f}s ago)" for r in rows[:20]]
        raise AirflowException("\n".join(lines))


class StreamHealthSummaryOperator(BaseOperator):
    """
    One verdict for a health-check run: reads each check's state and ``eos_check`` XCom and
    fails with a readable summary if any check failed. Use ``trigger_rule="all_done"``.

    A liveness failure (no recent batch) while the caught-up check passed is reported as
    ``idle`` and does not fail the summary: a stream with no new input writes no progress rows.

    Given ``pipeline``, it first sends what the checks measured (passed or failed) through
    Airflow's Stats: LSO lag and seconds stuck per partition, records behind per partition,
    the last batch's age, new dead letters, in-doubt transactions (docs/metrics.md).

    :param check_task_ids: the checks' task ids, in display order.
    :param liveness_task_id: task id of the liveness sensor (for the idle rule).
    :param caught_up_task_id: task id of the caught-up sensor (for the idle rule).
    :param pipeline: the pipeline checked, naming its metrics; None sends none.
    """

    template_fields: Sequence[str] = ()

    def __init__(self, *, check_task_ids: Sequence[str], liveness_task_id: str | None = None,
                 caught_up_task_id: str | None = None, pipeline: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", "all_done")
        super().__init__(**kwargs)
        self.check_task_ids = list(check_task_ids)
        self.liveness_task_id = liveness_task_id
        self.caught_up_task_id = caught_up_task_id
        self.pipeline = pipeline

    def _states(self, context: Any) -> dict[str, str]:
        ti = context["ti"]
        try:
            states = ti.get_task_states(dag_id=ti.dag_id, task_ids=self.check_task_ids, run_ids=[ti.run_id])
            return {str(k): str(v) for k, v in (states.get(ti.run_id) or {}).items()}
        except Exception as err:  # older task SDKs: fall back on the XComs alone
            self.log.warning("cannot read the checks' states (%s); judging by their XComs", err)
            return {}

    def execute(self, context: Any) -> dict[str, Any]:
        ti = context["ti"]
        states = self._states(context)
        results: dict[str, dict[str, Any]] = {}
        reports: dict[str, Any] = {}
        for task_id in self.check_task_ids:
            outcome = ti.xcom_pull(task_ids=task_id, key=CHECK_XCOM_KEY)
            if outcome is not None and outcome.get("check"):
                reports[str(outcome["check"])] = outcome.get("report")
            outcome = {k: v for k, v in (outcome or {}).items() if k != "report"} or None
            state = states.get(task_id)
            if outcome is None:
                if state == "success":
                    outcome = {"ok": True, "message": "passed"}
                else:
                    outcome = {"ok": False, "message": f"ended {state or 'without a result'} (see its log)"}
            if state is not None and state not in ("success", "failed") and outcome.get("ok"):
                outcome = {**outcome, "ok": state == "skipped", "message": f"{state}: {outcome.get('message')}"}
            results[task_id] = {"state": state, **outcome}
        if self.pipeline:
            # Before the verdict: an unhealthy run's numbers are the ones that matter most.
            sent = emit(health_metrics(self.pipeline, reports))
            self.log.info("Sent %d metrics of pipeline %r through Airflow's Stats", sent, self.pipeline)
        live, caught = results.get(self.liveness_task_id or ""), results.get(self.caught_up_task_id or "")
        if live and caught and not live["ok"] and caught["ok"]:
            live["ok"] = True
            live["idle"] = True
            live["message"] = f"idle (caught up, no new input): {live['message']}"
        failed = [t for t, r in results.items() if not r["ok"]]
        lines = [f"Stream health: {'FAILED' if failed else 'OK'} ({len(failed)} of {len(results)} checks failed)"]
        for task_id, result in results.items():
            mark = "OK  " if result["ok"] else "FAIL"
            body = str(result.get("message") or "").strip().replace("\n", "\n        ")
            lines.append(f"  [{mark}] {task_id}: {body}")
        summary = "\n".join(lines)
        if failed:
            raise AirflowException(summary)
        self.log.info("%s", summary)
        return {"ok": True, "checks": results}
