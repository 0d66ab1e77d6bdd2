"""The compact letter display (insert-absorb) on hand-worked cases and on random relations."""

import itertools
import random

import pytest

from harness.report.letters import letter_columns, letters


def test_nothing_told_apart_is_one_letter():
    assert letters(["A", "B", "C"], []) == {"A": "a", "B": "a", "C": "a"}


def test_everything_told_apart_is_one_letter_each():
    items = ["A", "B", "C"]
    assert letters(items, itertools.combinations(items, 2)) == {"A": "a", "B": "b", "C": "c"}


def test_the_ends_told_apart_share_the_middle():
    # A > B > C; only A vs C is told apart: B cannot be told from either.
    assert letters(["A", "B", "C"], [("A", "C")]) == {"A": "a", "B": "ab", "C": "b"}


def test_piepho_style_example_by_hand():
    # Four settings best first; told apart: A-C, A-D, B-D. Insert-absorb by hand:
    # {ABCD} -> A-C: {BCD},{ABD} -> A-D: {BCD},{BD}x,{AB} -> absorb {BD} in {BCD}
    # -> B-D: {CD},{BC},{AB}. Ordered by best member: {AB}=a, {BC}=b, {CD}=c.
    got = letters(["A", "B", "C", "D"], [("A", "C"), ("A", "D"), ("B", "D")])
    assert got == {"A": "a", "B": "ab", "C": "bc", "D": "c"}


def test_one_setting_alone_told_apart_from_the_rest():
    got = letters(["A", "B", "C", "D"], [("A", "B"), ("A", "C"), ("A", "D")])
    assert got == {"A": "a", "B": "b", "C": "b", "D": "b"}


def test_the_best_setting_is_always_a():
    got = letters(["A", "B", "C"], [("B", "C"), ("A", "B")])
    assert got["A"].startswith("a")


def test_a_pair_of_one_item_is_refused():
    with pytest.raises(ValueError, match="itself"):
        letter_columns(["A"], [("A", "A")])


@pytest.mark.parametrize("seed", range(40))
def test_letters_share_exactly_when_not_told_apart(seed):
    """The display's contract on random relations: two settings share a letter if and only if
    they were not told apart, and no letter column is inside another."""
    rng = random.Random(seed)
    items = list(range(rng.randint(1, 8)))
    pairs = list(itertools.combinations(items, 2))
    apart = {p for p in pairs if rng.random() < 0.4}
    got = letters(items, sorted(apart))
    for a, b in pairs:
        assert (set(got[a]) & set(got[b]) == set()) == ((a, b) in apart), (a, b, got)
    columns = letter_columns(items, sorted(apart))
    assert not any(x < y for x in columns for y in columns)
    assert all(got[i] for i in items)
