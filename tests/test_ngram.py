"""scheduler/ngram.py: n-gram prompt lookup, against a brute-force reading of its rule."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.ngram import propose


def test_the_longest_suffix_found_earlier_gives_the_tokens_that_followed_it():
    code = [5, 6, 7, 8, 9, 1, 5, 6, 7]  # "5 6 7" was followed by "8 9"
    assert propose(code, k=2, min_n=1, max_n=3) == [8, 9]
    assert propose(code, k=5, min_n=1, max_n=3) == [8, 9, 1, 5, 6]  # runs into the suffix itself


def test_the_latest_occurrence_wins_and_no_match_is_no_draft():
    assert propose([1, 2, 3, 1, 2, 4, 1, 2], k=1, min_n=2, max_n=2) == [4]
    assert propose([1, 2, 3, 4], k=3, min_n=1, max_n=4) == []
    assert propose([7], k=3) == []


def test_a_bad_configuration_is_a_value_error():
    with pytest.raises(ValueError, match="need k >= 1"):
        propose([1, 2], k=0)
    with pytest.raises(ValueError, match="need k >= 1"):
        propose([1, 2], k=1, min_n=3, max_n=2)


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[len(tokens) - n:]]
        if starts:
            return tokens[max(starts) + n:max(starts) + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), k=st.integers(1, 6), min_n=st.integers(1, 3),
       extra=st.integers(0, 3))
def test_the_draft_is_the_brute_force_rules(tokens, k, min_n, extra):
    assert propose(tokens, k, min_n, min_n + extra) == brute_force(tokens, k, min_n, min_n + extra)
