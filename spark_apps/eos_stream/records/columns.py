"""Rows of one width kept as columns, one list per field (:class:`Columns`).

A Spark task that reports tens of thousands of rows to the driver (a whole mirror's transaction
groups) pickles them; pickle writes a list of ints or strings in C, but a tuple per row costs an
object more to make, to pickle, to unpickle and to read again: per 100,000 rows of twelve fields,
63 ms to pickle as tuples and 36 to unpickle them, 20 and 17 as columns (measured offline).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

_Self = TypeVar("_Self", bound="Columns")


class Columns:
    """Rows as columns. ``WIDTH``: the fields of a row; 0 for rows of any width, whose columns
    are made by the first rows given. Pickles as its lists."""

    __slots__ = ("columns",)
    WIDTH = 0

    def __init__(self, columns: tuple[list, ...] | None = None) -> None:
        self.columns: tuple[list, ...] = columns if columns is not None else tuple([] for _ in range(self.WIDTH))

    @classmethod
    def of(cls: type[_Self], rows: Iterable[tuple]) -> _Self:
        """The columns of ``rows``."""
        made = list(rows)
        return cls(tuple(map(list, zip(*made, strict=True)))) if made else cls()

    @classmethod
    def joined(cls: type[_Self], parts: Iterable[Columns]) -> _Self:
        """The rows of ``parts``, one after the other (the columns copied: no part changes)."""
        joined = cls()
        for part in parts:
            if not len(part):
                continue
            if not joined.columns:
                joined.columns = tuple([] for _ in part.columns)
            for column, more in zip(joined.columns, part.columns, strict=True):
                column += more
        return joined

    def where(self: _Self, keep: Iterable[bool]) -> _Self:
        """The rows for which ``keep`` is true, in order."""
        return self.at([i for i, wanted in enumerate(keep) if wanted])

    def at(self: _Self, rows: list[int]) -> _Self:
        """The rows at the indexes ``rows``, in their order."""
        return type(self)(tuple(list(map(column.__getitem__, rows)) for column in self.columns))

    def __reduce__(self) -> tuple[type, tuple[tuple[list, ...]]]:
        return type(self), (self.columns,)

    def __len__(self) -> int:
        return len(self.columns[0]) if self.columns else 0

    def __iter__(self) -> Iterator[Any]:
        return zip(*self.columns, strict=True)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Columns) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"
