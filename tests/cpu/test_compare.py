"""Property: over random id sequences with one random edit (insert, delete, substitute) at a
random position, the comparator reports exactly the first index where the edit changed them."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from rlbench.checks.compare import Divergence, first_divergence, locate

ids = st.lists(st.integers(0, 50), min_size=0, max_size=200)
# The numpy path (512+ ids). Built from a drawn seed and length: hypothesis drawing 1,500 list elements
# one by one took 0.4 s an example; shrinking still works on the seed and the length.
long_ids = st.builds(
    lambda seed, n: random.Random(seed).choices(range(51), k=n), st.integers(0, 2**32 - 1), st.integers(512, 1500)
)


@st.composite
def edited(draw):
    """(original, edited, the first index that differs). An edit that leaves the id at its index
    unchanged (inserting a copy of the id already there) moves the first difference right; the
    expected index follows the edit exactly so that no such case is excluded."""
    seq = draw(ids)
    kind = draw(st.sampled_from(["insert", "delete", "substitute"] if seq else ["insert"]))
    pos = draw(st.integers(0, len(seq) if kind == "insert" else len(seq) - 1))
    if kind == "insert":
        new = seq[:pos] + [draw(st.integers(0, 50))] + seq[pos:]
    elif kind == "delete":
        new = seq[:pos] + seq[pos + 1 :]
    else:
        new = seq[:pos] + [draw(st.integers(0, 50).filter(lambda t: t != seq[pos]))] + seq[pos + 1 :]
    # The index the edit actually changed: scan from `pos` (everything before it is untouched).
    first = pos
    while first < min(len(seq), len(new)) and seq[first] == new[first]:
        first += 1
    return seq, new, first


@settings(max_examples=300, deadline=None, database=None)
@given(edited())
def test_reports_exactly_the_first_edited_index(case):
    original, new, first = case
    assert first_divergence(original, new) == first
    assert first_divergence(new, original) == first
    found = locate(original, new)
    assert found.index == first
    assert found.expected == tuple(original[found.window_start : first + 5])


@settings(max_examples=100, deadline=None, database=None)
@given(ids)
def test_equal_sequences_have_no_divergence(seq):
    assert first_divergence(seq, list(seq)) is None and locate(seq, seq) is None


def test_substitution_at_every_position_of_a_fixed_sequence():
    seq = list(range(10))
    for pos in range(10):
        edited_seq = seq[:pos] + [99] + seq[pos + 1 :]
        assert first_divergence(seq, edited_seq) == pos


@settings(max_examples=50, deadline=None, database=None)
@given(long_ids, st.data())
def test_long_sequences_take_the_array_path_and_agree(seq, data):
    pos = data.draw(st.integers(0, len(seq) - 1))
    new = seq[:pos] + [data.draw(st.integers(0, 50).filter(lambda t: t != seq[pos]))] + seq[pos + 1 :]
    assert first_divergence(seq, new) == pos
    assert first_divergence(seq, seq[:pos]) == pos  # a strict prefix parts at its length


def test_locate_shows_the_same_window_of_both_sequences_around_the_divergence():
    a = list(range(20))
    b = a[:10] + [99] + a[11:]
    assert locate(a, b) == Divergence(10, tuple(range(6, 15)), (6, 7, 8, 9, 99, 11, 12, 13, 14), 6)
    assert locate(a, b, context=2) == Divergence(10, (8, 9, 10, 11, 12), (8, 9, 99, 11, 12), 8)
    assert locate([5, 6, 7], [5, 0, 7]) == Divergence(1, (5, 6, 7), (5, 0, 7), 0)  # the window starts at 0
    assert locate([1, 2, 3, 4], [1, 2]) == Divergence(2, (1, 2, 3, 4), (1, 2), 0)  # a strict prefix
    long = list(range(600))
    assert first_divergence(long, long[:-1] + [7]) == 599 and first_divergence(long + [1], long) == 600
