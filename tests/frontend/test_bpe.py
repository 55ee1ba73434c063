"""tiktoken's encoding of a byte-level BPE gives the HF tokenizer's ids, or is not used."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from orchestrator.frontend.bpe import fast_bpe
from orchestrator.frontend.preprocessor import Preprocessor
from tests.frontend.tokenizer_dirs import build_chatml, build_llama, build_llama3

DOCS = Path(__file__).resolve().parents[2] / "docs"

# Text the regexes split in every way: letters of several scripts, digits, marks, symbols,
# punctuation, separators and controls, with the specials and the contractions mixed in.
_CHARACTERS = st.characters(codec="utf-8", categories=("L", "M", "N", "P", "S", "Z", "Cc", "Cf", "Co"))
_PIECES = st.one_of(
    st.text(_CHARACTERS, max_size=12),
    st.sampled_from(["'s", "'LL", " 's", "\u2019re", "\n\n", "\r\n", "  ", "\t", " \u00a0", "1234", "١٢٣"]),
    st.sampled_from(
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>", "<|im_start"]
    ),
)
_TEXTS = st.lists(_PIECES, max_size=30).map("".join)


def _hf_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    return Preprocessor.load(build_chatml(tmp_path_factory.mktemp("chatml")))


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> Preprocessor:
    return Preprocessor.load(smollm2_dir)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    return Preprocessor.load(build_llama3(tmp_path_factory.mktemp("llama3")))


@pytest.mark.parametrize("name", ["chatml", "llama3", "smollm2"])
def test_byte_level_bpe_models_encode_by_tiktoken_as_hf_does(
    name: str, request: pytest.FixtureRequest
) -> None:
    pre: Preprocessor = request.getfixturevalue(name)
    fast = pre._fast_bpe
    assert fast is not None
    # This repository's docs: prose, code, tables, JSON and benchmark figures.
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text()
        for start in range(0, len(text), 4000):
            chunk = text[start : start + 4000]
            assert fast.encode(chunk) == _hf_ids(pre.tokenizer, chunk), f"{path.name} at {start}"

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(text=_TEXTS)
    def alike(text: str) -> None:
        assert pre.encode(text, False) == _hf_ids(pre.tokenizer, text)
        for add_special_tokens in (False, True):
            ids = fast.encode(text, add_special_tokens)
            assert ids is None or ids == _hf_ids(pre.tokenizer, text, add_special_tokens)

    alike()


def test_a_byte_without_a_token_of_its_own_is_left_to_hf(smollm2: Preprocessor) -> None:
    """SmolLM2 has no token for "\\x04" alone: HF drops the byte, which tiktoken cannot."""
    fast = smollm2._fast_bpe
    assert fast is not None
    text = "a\x04b, then more text"
    assert fast.encode(text) is None
    assert smollm2.encode(text, False) == _hf_ids(smollm2.tokenizer, text)
    assert fast.encode("a b, then more text") is not None


def test_a_text_tiktokens_regex_engine_cannot_split_is_left_to_hf(smollm2: Preprocessor) -> None:
    """A million spaces in a row overflow the stack of tiktoken's regex engine (0.14)."""
    text = " " * 1_000_000 + "end"
    fast = smollm2._fast_bpe
    assert fast is not None and fast.encode(text) is None
    assert smollm2.encode(text, False) == _hf_ids(smollm2.tokenizer, text)


def _spec(tmp_path: Path) -> dict[str, Any]:
    return dict(json.loads(build_chatml(tmp_path / "tok").joinpath("tokenizer.json").read_text()))


def _fast(spec: dict[str, Any]) -> bool:
    return fast_bpe(Tokenizer.from_str(json.dumps(spec)), spec) is not None


def test_other_tokenizers_stay_with_hf(tmp_path: Path) -> None:
    assert _fast(_spec(tmp_path))
    llama = json.loads(build_llama(tmp_path / "llama").joinpath("tokenizer.json").read_text())
    assert not _fast(llama)  # SentencePiece-style: a normalizer, byte fallback
    normalized = _spec(tmp_path)
    normalized["normalizer"] = {"type": "NFC"}
    assert not _fast(normalized)
    stripped = _spec(tmp_path)
    stripped["added_tokens"][1]["lstrip"] = True
    assert not _fast(stripped)
    prefixed = _spec(tmp_path)
    prefixed["pre_tokenizer"]["add_prefix_space"] = True
    assert not _fast(prefixed)
    # Two merges listed in the other order than their tokens' ids: the orders disagree.
    swapped = _spec(tmp_path)
    merges = swapped["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]
    assert not _fast(swapped)


def test_a_vocabulary_whose_merges_do_not_reach_a_whole_token_stays_with_hf() -> None:
    """ "abc" is a token, made by merging "ab" and "c"; but "b c" merges first, so HF's BPE
    gives "a" "bc" for it, while tiktoken takes a piece that is a token as that token. The
    start-up check sees the two differ. With `ignore_merges`, HF takes it whole too."""
    alphabet = {chr(c): c for c in range(ord("a"), ord("d"))}
    vocab = {**alphabet, "bc": 300, "ab": 301, "abc": 302}
    byte_level = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    spec: dict[str, Any] = {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {**byte_level, "add_prefix_space": False},
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "vocab": vocab, "merges": ["b c", "a b", "ab c"], "ignore_merges": False},
    }
    assert Tokenizer.from_str(json.dumps(spec)).encode("abc").ids == [ord("a"), 300]
    assert not _fast(spec)
    spec["model"]["ignore_merges"] = True
    assert Tokenizer.from_str(json.dumps(spec)).encode("abc").ids == [302]
    assert _fast(spec)


def test_a_post_processor_that_adds_tokens_is_left_to_hf(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    fast = fast_bpe(tokenizer, spec)
    assert fast is not None
    assert fast.encode("hello there", add_special_tokens=True) is None
    assert fast.encode("hello there") == _hf_ids(tokenizer, "hello there")
    assert _hf_ids(tokenizer, "hello there", True)[0] == 1
