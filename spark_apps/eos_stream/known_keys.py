"""How an unknown key is refused, at every level of a pipeline definition: the key, the nearest
allowed one ("did you mean"), and every key allowed there. One wording for the definition's
pydantic sections (``airflow_provider_eos.utils.pipeline_definition``) and the ``mirror``
section, which the app parses without pydantic (``cdc.definition``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def unknown_key_message(key: str, allowed: Iterable[str]) -> str:
    """What to tell a user who wrote ``key`` where only ``allowed`` are known."""
    names = sorted(allowed)
    nearest = difflib.get_close_matches(key, names, n=1)
    hint = f"did you mean {nearest[0]!r}? " if nearest else ""
    return f"unknown key; {hint}allowed here: {', '.join(names)}"
