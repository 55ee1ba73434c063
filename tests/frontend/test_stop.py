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
    out.append(matcher.flush())
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


def test_after_a_match_nothing_more_is_emitted() -> None:
    matcher = StopStringMatcher(["."])
    assert matcher.feed("One. Two.") == ("One", True)
    assert matcher.stopped
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


@given(
    text=st.text(alphabet="abc\n日", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n日", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_streamed_result_equals_matching_the_whole_text(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, matched = run(stops, deltas)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    assert matched == bool(hits)
    assert "".join(out) == (text[: min(hits)] if hits else text)
