"""Records with schemas, their schema read once per text.

Connect's JSON converter with ``schemas.enable`` writes each record as
``{"schema":S,"payload":P}``, and S, the same text for every record of a table, is most of it:
2,600 of a change's 3,300 bytes in the CDC bench, and three quarters of its decoding (msgspec
still scans a field it keeps raw, and the schema cache hashes S to find what it derived).

:class:`KnownSchemas` remembers the prefix ``{"schema":S,"payload":`` of every record decoded
whole, with what was derived from S. A record that begins with a remembered prefix and ends with
``}`` holds that same S, byte for byte, and its payload between the two, so only the payload is
decoded: a JSON document is that record's payload exactly when it is one JSON value, which the
payload's decoder checks. Anything else (a schema not seen yet, whitespace the converter never
writes, a record cut short) is decoded whole, as it was before, and gives its verdict there.
"""

from __future__ import annotations

from typing import Generic, TypeVar

_OPEN = b'{"schema":'
_PAYLOAD = b',"payload":'
_MAX_KNOWN = 64  # a schema per table and side; only a pipeline of very many tables clears it

Derived = TypeVar("Derived")


class KnownSchemas(Generic[Derived]):
    """Prefixes of records decoded whole, each with what was derived from its schema (for the
    row schemas' cache, a value shared by every record of that schema: nothing may change it)."""

    def __init__(self) -> None:
        self.known: dict[bytes, Derived] = {}
        # The prefix matched last, with its derived schema: one tuple, assigned at once, because
        # threads may share a cache (a record of a table mostly follows one of the same table).
        self.last: tuple[bytes, Derived] | None = None

    def payload(self, record: bytes) -> tuple[bytes, Derived] | None:
        """The payload's text and the schema's derived value, when ``record`` begins with a
        known prefix and ends with ``}``; else None (the record is to be decoded whole)."""
        if record[-1:] != b"}":
            return None
        last = self.last
        if last is None or not record.startswith(last[0]):
            prefix = next((known for known in self.known if record.startswith(known)), None)
            if prefix is None:
                return None
            last = self.last = (prefix, self.known[prefix])
        return record[len(last[0]):-1], last[1]

    def learn(self, record: bytes, schema: bytes, derived: Derived) -> None:
        """Remembers the prefix of ``record``, decoded whole: its ``schema`` text, and what was
        derived from it. A record the converter did not write compactly is not remembered."""
        prefix = _OPEN + schema + _PAYLOAD
        if not record.startswith(prefix) or record[-1:] != b"}":
            return
        if len(self.known) >= _MAX_KNOWN:
            self.known.clear()
        self.known[prefix] = derived
        self.last = (prefix, derived)
