"""How a stream's supervisor fails its task: one exception per kind of end that no restart can
mend (see :mod:`.supervision`), with a message that says what happened and what to do."""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_eos.operators.supervision import Counters, Fail, FailKind, RestartPolicy, exhausted_message


class AppRefusedConfigError(AirflowFailException):
    """The app refused its configuration (it exited 2): retrying will not help."""


class PipelineDataLostError(AirflowFailException):
    """A stored offset of the pipeline is no longer held by Kafka (retention, or a recreated
    topic): retrying will not help."""


class PipelineTakenOverError(AirflowException):
    """The app was fenced and another driver of the pipeline now holds its running lock:
    starting this one again would make two drivers fence each other in turn."""


def failure(step: Fail, pipeline: str, attempts: list[dict[str, Any]], counters: Counters, policy: RestartPolicy,
            connections: dict[str, str]) -> AirflowException:
    """The exception that fails the task for ``step``.

    :param attempts: every attempt's summary line (:func:`~.supervision.attempt_info`), the last
        one the run that ended.
    :param counters: the restarts made so far.
    :param connections: the task's connection ids by role, named when the app refused its config."""
    reason = attempts[-1]["reason"]
    if step.kind is FailKind.KILLED:
        return AirflowException(f"pipeline {pipeline!r} was killed: {reason}")
    if step.kind is FailKind.CONFIG:
        return AppRefusedConfigError(
            f"pipeline {pipeline!r}: configuration error, not restarted: {reason} "
            f"(connections: kafka {connections.get('kafka')!r}, postgres {connections.get('postgres')!r})")
    if step.kind is FailKind.DATA_LOST:
        return PipelineDataLostError(
            f"pipeline {pipeline!r}: {reason}. Kafka no longer holds records this pipeline has not applied "
            "(retention deleted them, or the topic was recreated): every restart would fail the same way, "
            "so none is made. The stored offsets must be moved on purpose before the pipeline can run again.")
    if step.kind is FailKind.TAKEN_OVER:
        other = step.other_driver or {}
        return PipelineTakenOverError(
            f"pipeline {pipeline!r} was fenced ({reason}) and another driver now holds its "
            f"running lock (database backend pid {other.get('pid')}, application "
            f"{other.get('application_name')!r}, client {other.get('client_addr')}:{other.get('client_port')}, "
            f"connected since {other.get('backend_start')}): it took the pipeline over. Not starting a "
            "second driver; stop that one first if this task should run the pipeline.")
    if step.kind is FailKind.FENCED_EXHAUSTED:
        return AirflowException(exhausted_message(
            pipeline, attempts, f"fenced restarts exhausted ({counters.fenced_restarts} restarts, "
            f"max_fenced_restarts {policy.max_fenced_restarts}): something keeps taking the target over"))
    return AirflowException(exhausted_message(pipeline, attempts))
