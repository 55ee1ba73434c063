"""Stop strings over streamed text: matches across deltas, hold-back, flush."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.frontend.stop import StopStringMatcher


def run(stops: list[str], deltas: list[str], include_stop: bool = False) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stops, include_stop=include_stop)
    out, matched = [], False
    for delta in deltas:
        text, matched = matcher.feed(delta)
        out.append(text)
        if matched:
            return out, True
    text, matched = matcher.feed("", final=True)
    out.append(text)
    return out, matched


def test_stop_split_across_deltas() -> None:
    out, matched = run(["STOP"], ["Hello wor", "ld ST", "O", "P and more"])
    assert matched
    assert out == ["Hello wor", "ld ", "", ""]


def test_partial_match_that_fails_is_released() -> None:
    out, matched = run(["</end>"], ["a </e", "nvelope>", " b"])
    assert not matched
    assert out == ["a ", "</envelope>", " b", ""]


def test_held_text_is_flushed_at_the_end() -> None:
    out, matched = run(["\n\n"], ["para\n"])
    assert not matched
    assert out == ["para", "\n"]


def test_earliest_stop_wins_and_include_stop() -> None:
    assert run(["world", "lo"], ["hello world"]) == (["hel"], True)
    assert run(["world", "lo"], ["hello world"], include_stop=True) == (["hello"], True)
    assert run(["abc", "bcd"], ["xab", "cd"]) == (["x", ""], True)


def test_a_complete_stop_waits_for_a_longer_one_that_began_earlier() -> None:
    # "a" is complete after "\na", but "\naa" began earlier and may still complete.
    assert run(["a", "\naa"], ["\na", "a"]) == (["", ""], True)
    # It does not complete: the shorter, later stop wins, at the end or on the next delta.
    assert run(["a", "\naa"], ["\na"]) == (["", "\n"], True)
    assert run(["a", "\naa"], ["\na", "b"]) == (["", "\n"], True)


def test_at_equal_starts_the_shortest_stop_wins() -> None:
    assert run(["abc", "ab"], ["xab", "c"], include_stop=True) == (["xab"], True)
    assert run(["abc", "ab"], ["xabc"], include_stop=True) == (["xab"], True)


def test_after_a_match_nothing_more_is_emitted() -> None:
    matcher = StopStringMatcher(["."])
    assert matcher.feed("One. Two.") == ("One", True)
    assert matcher.stopped
    assert matcher.feed("more") == ("", True)
    assert matcher.feed("", final=True) == ("", True)


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.feed("", final=True) == ("", False)


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


@given(
    text=st.text(alphabet="abc\n日", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n日", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
    include_stop=st.booleans(),
)
def test_streamed_result_equals_matching_the_whole_text(
    text: str, stops: list[str], cuts: list[int], include_stop: bool
) -> None:
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, matched = run(stops, deltas, include_stop)
    # The whole text at once: the earliest start, and at equal starts the shortest stop.
    hits = sorted((at, len(s)) for s in stops if (at := text.find(s)) >= 0)
    assert matched == bool(hits)
    if not hits:
        assert "".join(out) == text
    else:
        start, length = hits[0]
        assert "".join(out) == text[: start + length if include_stop else start]
