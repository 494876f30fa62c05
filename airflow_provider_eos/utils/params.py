"""Values that arrive through templated fields and DAG Params, as plain Python."""

from __future__ import annotations

from typing import Any

_TRUE = frozenset({"1", "true", "yes", "on"})


def as_bool(value: Any) -> bool:
    """A templated flag: rendered Jinja gives strings ("True", "false"), Params give booleans."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE
    return bool(value)
