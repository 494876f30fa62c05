"""Runs a deferrable task to its end in this process, the way a worker and the triggerer would:
``execute`` until it defers, the trigger re-created from its serialized form and run with
asyncio until its first event, then the task resumed with that event."""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Callable
from typing import Any

from airflow.sdk.exceptions import TaskDeferred


def run_deferrable(operator: Any, context: dict[str, Any], timeout: float = 900.0,
                   on_defer: Callable[[], None] | None = None) -> tuple[Any, bool]:
    """The task's result and whether it deferred (exceptions of the task propagate).

    :param on_defer: called once the task has deferred, before its trigger runs: what a test
        makes happen while the trigger waits (a timer started there fires during the wait).
    """
    try:
        return operator.execute(context), False
    except TaskDeferred as deferred:
        if on_defer is not None:
            on_defer()
        classpath, kwargs = deferred.trigger.serialize()
        module, _, name = classpath.rpartition(".")
        trigger = getattr(importlib.import_module(module), name)(**json.loads(json.dumps(kwargs)))
        event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), timeout))
        method = getattr(operator, deferred.method_name)
        return method(context, event=event.payload, **(deferred.kwargs or {})), True
