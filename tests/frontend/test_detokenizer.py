"""Incremental detokenization: streamed text equals a full decode, however the ids are chunked.

Every test runs on both fixture tokenizers, so on both implementations: the byte-level one
(chatml) streams through `ByteDetokenizer`'s byte table, the SentencePiece-style one (llama)
through `StreamDetokenizer`; SmolLM2's real tokenizer gets the random-ids test too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders

from orchestrator.frontend.detokenizer import ByteDetokenizer, StreamDetokenizer, _decodes_alike, byte_tables
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


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    return Preprocessor.load(build_chatml(tmp_path_factory.mktemp("chatml") / "tok"))


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


def test_byte_level_tokenizers_take_the_byte_table_and_others_the_stream(pre: Preprocessor) -> None:
    byte_level = pre.tokenizer.decoder.__class__.__name__ == "ByteLevel"
    expected = ByteDetokenizer if byte_level else StreamDetokenizer
    assert type(pre.detokenizer()) is expected
    assert type(pre.detokenizer(skip_special_tokens=False)) is expected


def test_byte_tables_only_for_a_plain_byte_level_decoder_that_decodes_alike(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_file(str(build_chatml(tmp_path / "tok") / "tokenizer.json"))
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    token = next(t for t in vocab if len(t) > 2)
    tokenizer.add_tokens(["Ġ" + token])  # an added token's content goes through the decoder too
    tables = byte_tables(tokenizer)
    assert tables is not None
    added = tokenizer.token_to_id("Ġ" + token)
    assert tables[True][added] == tokenizer.decode([added]).encode()
    assert tables[True][added].startswith(b" ")  # "Ġ" is the byte-level alphabet's space
    # The load-time check refuses a table that decodes otherwise than the tokenizer.
    wrong = list(tables[True])
    wrong[vocab[token]] += b"!"
    assert not _decodes_alike(tokenizer, wrong, skip_special_tokens=True)
    # A decoder that does more than ByteLevel (here a Strip after it) gets the stream.
    tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(content=" ")])
    assert byte_tables(tokenizer) is None


def stream_random_ids(pre: Preprocessor, ids: list[int], sizes: list[int], skip: bool) -> str:
    detok = pre.detokenizer(skip_special_tokens=skip)
    pieces, at = [], 0
    for size in sizes:
        pieces.append(detok.step(ids[at : at + size]))
        at += size
    pieces.append(detok.step(ids[at:], final=True))
    return "".join(pieces)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_random_ids_in_random_chunks_equal_a_full_decode(
    chatml: Preprocessor, data: st.DataObject, skip: bool
) -> None:
    # Any ids, special and unknown ones included: lone continuation bytes, unfinished
    # characters at the end, specials between the bytes of a character. Byte-level only: with
    # byte fallback a full decode turns every byte of an invalid run into U+FFFD, including
    # a valid prefix the stream has already sent (detokenizer.py's docstring).
    pre = chatml
    ids = data.draw(st.lists(st.integers(0, pre.vocab_size + 3), max_size=24))
    sizes = data.draw(st.lists(st.integers(0, 4), max_size=8))
    assert stream_random_ids(pre, ids, sizes, skip) == pre.decode(
        [i for i in ids if i < pre.vocab_size], skip_special_tokens=skip
    )


@pytest.mark.slow
def test_smollm2_random_ids_equal_a_full_decode(smollm2_dir: Path) -> None:
    pre = Preprocessor.load(smollm2_dir)
    assert type(pre.detokenizer()) is ByteDetokenizer
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(pre.vocab_size) for _ in range(rng.randint(1, 40))]
        sizes = [rng.randint(0, 3) for _ in range(rng.randint(0, 10))]
        skip = rng.random() < 0.5
        assert stream_random_ids(pre, ids, sizes, skip) == pre.decode(ids, skip_special_tokens=skip)
