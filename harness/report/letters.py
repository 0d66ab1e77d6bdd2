"""Compact letter display of multiple comparisons (Piepho 2004, "insert-absorb").

Settings that share a letter could not be told apart after correction; two settings with no
letter in common were. The display is built from the pairs that *were* told apart: start with
one letter column holding every setting; for each such pair, every column holding both is split
in two (one without each of the pair: insert), then any column whose settings all lie in another
column is dropped (absorb). Letters go to the columns in the order of their best setting, so
the best setting is always "a".
"""

from __future__ import annotations

import string
from typing import Hashable, Iterable, Sequence

LETTERS = string.ascii_lowercase + string.ascii_uppercase


def letter_columns(items: Sequence[Hashable], apart: Iterable[tuple[Hashable, Hashable]]
                   ) -> list[frozenset]:
    """The letter columns (sets of items) for `items` (best first) and the pairs told apart."""
    columns: list[frozenset] = [frozenset(items)] if items else []
    for a, b in apart:
        if a == b:
            raise ValueError(f"a setting cannot be told apart from itself: {a!r}")
        split = []
        for column in columns:
            if a in column and b in column:
                split += [column - {a}, column - {b}]
            else:
                split.append(column)
        columns = _absorb(split)
    order = {item: i for i, item in enumerate(items)}
    return sorted(columns, key=lambda c: sorted(order[i] for i in c))


def _absorb(columns: list[frozenset]) -> list[frozenset]:
    """Drop columns contained in another (and duplicates), keeping the first of equals."""
    kept: list[frozenset] = []
    for i, column in enumerate(columns):
        inside = any(column < other or (column == other and j < i)
                     for j, other in enumerate(columns) if j != i)
        if not inside:
            kept.append(column)
    return kept


def letters(items: Sequence[Hashable], apart: Iterable[tuple[Hashable, Hashable]]
            ) -> dict[Hashable, str]:
    """{item: its letters} ("a", "ab", ...) for `items` ordered best first."""
    columns = letter_columns(items, list(apart))
    if len(columns) > len(LETTERS):
        raise ValueError(f"{len(columns)} letter columns: more than {len(LETTERS)} letters")
    return {item: "".join(LETTERS[k] for k, c in enumerate(columns) if item in c)
            for item in items}
