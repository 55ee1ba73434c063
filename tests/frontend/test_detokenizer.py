"""Incremental detokenization: streamed text equals a full decode, however the ids are chunked."""

from __future__ import annotations

import random

import pytest

from orchestrator.frontend.preprocessor import Preprocessor
from tests.frontend.tokenizer_dirs import build_chatml, build_llama

TEXTS = [
    "Hello world, how are you?",
    "日本語のテキスト and ASCII mixed",
    "emoji 🎉👩‍👩‍👧 and accents: é à ü ß",
    "  leading spaces, trailing spaces  ",
    "line\nbreaks\n\n\tand tabs",
    "Zalgo: Z͑ͫ̓ͪ̂ͫ̽͏̴̙̤̞͉͚̯̞̠͍ and math ∀x∈\u2115",
]


@pytest.fixture(scope="module", params=["chatml", "llama"])
def pre(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    build = build_chatml if request.param == "chatml" else build_llama
    return Preprocessor.load(build(tmp_path_factory.mktemp(request.param) / "tok"))


def stream(pre: Preprocessor, chunks: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    detok = pre.detokenizer(skip_special_tokens=skip_special_tokens)
    return [detok.step(chunk) for chunk in chunks]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(pre: Preprocessor, text: str) -> None:
    ids = pre.encode(text, add_special_tokens=False)
    pieces = stream(pre, [[i] for i in ids])
    assert "".join(pieces) == pre.decode(ids)
    # A piece never holds half a character: U+FFFD would mean a split UTF-8 sequence leaked.
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("seed", range(5))
def test_random_chunking_equals_full_decode(pre: Preprocessor, seed: int) -> None:
    rng = random.Random(seed)
    ids = pre.encode(" ".join(TEXTS), add_special_tokens=False)
    chunks, at = [], 0
    while at < len(ids):
        size = rng.randint(0, 4)  # empty deltas happen (a finish-only frame) and must be harmless
        chunks.append(ids[at : at + size])
        at += size
    assert "".join(stream(pre, chunks)) == pre.decode(ids)


def test_character_split_across_tokens_is_emitted_once_complete(pre: Preprocessor) -> None:
    ids = pre.encode("a日", add_special_tokens=False)
    a_ids = pre.encode("a", add_special_tokens=False)
    char_ids = ids[len(a_ids) :]
    assert len(char_ids) >= 2, "the fixture tokenizers split non-ASCII characters into byte tokens"
    pieces = stream(pre, [a_ids] + [[i] for i in char_ids])
    assert pieces[0] == "a"
    assert pieces[1:-1] == [""] * (len(char_ids) - 1)
    assert pieces[-1] == "日"


def test_special_tokens_skipped_unless_asked(pre: Preprocessor) -> None:
    eos = pre.eos_token_ids[0]
    eos_text = pre.special_tokens["eos_token"]
    ids = [*pre.encode("Hi", add_special_tokens=False), eos]
    assert "".join(stream(pre, [[i] for i in ids])) == "Hi"
    assert "".join(stream(pre, [ids], skip_special_tokens=False)).endswith(eos_text)


def test_each_request_has_its_own_state(pre: Preprocessor) -> None:
    first, second = pre.detokenizer(), pre.detokenizer()
    one, two = pre.encode("日", add_special_tokens=False), pre.encode("Hello", add_special_tokens=False)
    assert first.step(one[:1]) == ""
    assert second.step(two) == "Hello"
    assert first.step(one[1:]) == "日"


def test_output_ending_inside_a_character_emits_what_was_held(pre: Preprocessor) -> None:
    # The output ends on the first byte of a multi-byte character: the stream holds that token
    # (and any text it carries) waiting for the rest; the final step emits it as a full decode
    # does, U+FFFD included, instead of dropping it.
    char_ids = pre.encode("日", add_special_tokens=False)
    assert len(char_ids) >= 2, "the fixture tokenizers split non-ASCII characters into byte tokens"
    ids = pre.encode("ok?", add_special_tokens=False) + char_ids[:1]
    detok = pre.detokenizer()
    pieces = [detok.step([i]) for i in ids[:-1]] + [detok.step(ids[-1:], final=True)]
    assert "".join(pieces) == pre.decode(ids)
