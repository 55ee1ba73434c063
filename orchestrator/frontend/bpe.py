"""Prompt text into token ids by tiktoken, for a model whose HF tokenizer it encodes exactly.

HF `tokenizers` takes about 1.5 µs a token here on a byte-level BPE prompt: 234 µs for a
150-token SmolLM2 chat prompt, the largest single cost in a short streamed request's frontend
CPU, and 1.4 ms for 2,000 tokens. tiktoken, OpenAI's BPE in Rust, gives the same ids in 26 µs.
Both cut the text at added tokens, split the rest into pieces by one regex, and merge each
piece's bytes pair by pair. `fast_bpe` builds a tiktoken `Encoding` from tokenizer.json
only where the two must agree, and the preprocessor keeps HF otherwise:

- BPE over GPT-2's byte alphabet: a ByteLevel pre-tokenizer splitting by its own regex
  (GPT-2's), or a Split by one regex followed by ByteLevel without one; no normalizer; no
  dropout, byte fallback, unknown token, subword prefix or word suffix;
- added tokens matched as they are written (no lstrip, rstrip or single_word), none of them
  inside another, so that tiktoken's leftmost match is HF's leftmost-longest one;
- merge results whose ids rise in merge order: tiktoken merges the adjacent pair whose join
  has the lowest id, HF the pair whose merge is listed first, and these are then one order.

Two differences remain possible in principle. tiktoken may join a pair that no merge lists
when their join is a token made by another split, and it takes a piece that is a whole token
as that token (HF's `ignore_merges`) where HF without that option runs the merges. So the
encoder is used only once it gave HF's ids for every token of the vocabulary written alone
and for a sample of every kind of character the pre-tokenizer regexes tell apart
(`_encodes_alike`, about 0.3 s for SmolLM2 at start-up). And a vocabulary may lack some
single bytes (SmolLM2's has no token for six ASCII control characters, nor for the lead bytes
of characters past U+3FFFF): HF drops such a byte where tiktoken has no way to, so a text that
holds one is left to HF.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tiktoken
from tokenizers import Tokenizer

from orchestrator.frontend.detokenizer import byte_level_bytes

# HF's ByteLevel pre-tokenizer regex (GPT-2's), as tiktoken writes it for GPT-2.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Every class the pre-tokenizer regexes split by: contractions (either case, and a typographic
# apostrophe, which is punctuation), letters of several scripts with combining marks, digit
# runs of several scripts, punctuation runs, each kind of whitespace alone, in runs and before
# text, line breaks, emoji (joined and with a skin tone), and characters outside the BMP.
_SAMPLE = (
    "I'm sure you'll see they've said it's 'quoted' and we'd go; THEY'LL, WE'RE, ID'S it\u2019s.\n"
    "Zürich naïve façade Ærø smørrebrød — São Paulo; ελληνικά, русский текст, עברית, العربية, "
    "हिन्दी, 中文字符, 日本語のかなカナ, 한국어 문장, ภาษาไทย, e\u0301 a\u0308\u0323.\n"
    "Numbers 0 12 345 6789 1234567890 3.14159 -42 +7e10 ١٢٣٤ \uff10\uff11\uff12 ²³ Ⅻ 1,000,000.\n"
    "Punctuation!!! ??? ... --- ((( ))) [[x]] {y} <tag/> @user #hash $5 %20 ^_^ &amp; *bold* ~~s~~ `code`\n"
    "  two  spaces\tand\ttabs\t\t\n\nblank lines\r\nCRLF\n\n\n  \n \u00a0nbsp\u3000ideographic\u2009thin "
    "\u200bzero-width\u2028line sep\u000bvt\u000cff\n"
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷 \U0001d518\U0001d52b\U0001d526 𠜎 trailing spaces   \n"
    "def f(x):\n    return {'a': [1, 2], \"b\": x ** 2}  # comment\n\tif x != None: pass\n"
)


class FastBPE:
    """tiktoken's encoding of one model's byte-level BPE (`fast_bpe` builds it)."""

    def __init__(self, encoding: tiktoken.Encoding, missing: bytes, post_processed: bool) -> None:
        self.encoding = encoding
        self._missing = missing  # the single bytes no token stands for
        self._post_processed = post_processed  # HF adds tokens (a BOS, say) when asked to

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int] | None:
        """HF's ids for `text`, its added tokens matched wherever they are written (as HF
        does); None where tiktoken cannot give them, which HF should take: a text with a byte
        no token stands for, special tokens to add by a post-processor, or a text its regex
        engine cannot split."""
        if add_special_tokens and self._post_processed:
            return None
        if self._missing:
            try:
                data = text.encode()
            except UnicodeEncodeError:  # a lone surrogate: HF's own error is the answer
                return None
            if len(data.translate(None, self._missing)) != len(data):
                return None
        try:
            return self.encoding.encode(text, allowed_special="all")
        except ValueError:  # its regex engine gave up (a million spaces in a row overflow its stack)
            return None


def fast_bpe(tokenizer: Tokenizer, spec: Mapping[str, Any]) -> FastBPE | None:
    """`tokenizer` (loaded from `spec`, its tokenizer.json) as tiktoken; None where it might
    not encode as HF does."""
    pattern = _pattern(spec.get("pre_tokenizer"))
    model = spec.get("model") or {}
    if pattern is None or spec.get("normalizer") is not None or model.get("type") != "BPE":
        return None
    options = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
    if any(model.get(option) for option in options):
        return None
    added = spec.get("added_tokens") or []
    if any(token.get(flag) for token in added for flag in ("lstrip", "rstrip", "single_word")):
        return None
    specials = {token["content"]: token["id"] for token in added}
    if any(a != b and a in b for a in specials for b in specials):
        return None
    ranks = _ranks(model, specials)
    if ranks is None or len(set(ranks.values())) != len(ranks):  # tiktoken needs one id a token
        return None
    try:
        encoding = tiktoken.Encoding(
            "weir-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
    except ValueError:  # a regex tiktoken's engine does not take
        return None
    missing = bytes(byte for byte in range(256) if bytes([byte]) not in ranks)
    post = spec.get("post_processor")
    fast = FastBPE(encoding, missing, post is not None and post.get("type") != "ByteLevel")
    return fast if _encodes_alike(tokenizer, fast, ranks) else None


def _pattern(pre_tokenizer: Mapping[str, Any] | None) -> str | None:
    """The one regex the pre-tokenizer splits by, where it does nothing else."""
    if not pre_tokenizer:
        return None
    if pre_tokenizer.get("type") == "ByteLevel":
        plain = pre_tokenizer.get("use_regex", True) and not pre_tokenizer.get("add_prefix_space")
        return GPT2_PATTERN if plain else None
    if pre_tokenizer.get("type") != "Sequence":
        return None
    steps = pre_tokenizer.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    regex = (split.get("pattern") or {}).get("Regex")
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or not isinstance(regex, str)
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex", True)
        or byte_level.get("add_prefix_space")
    ):
        return None
    return regex


def _ranks(model: Mapping[str, Any], specials: Mapping[str, int]) -> dict[bytes, int] | None:
    """Each vocabulary token's bytes -> its id, where the ids order the merges as HF does."""
    vocab: Mapping[str, int] = model.get("vocab") or {}
    ranks: dict[bytes, int] = {}
    for text, token_id in vocab.items():
        if text not in specials:
            token = byte_level_bytes(text)
            if token is None:  # a character outside the byte alphabet: not byte-level BPE
                return None
            ranks[token] = token_id
    last = -1
    for merge in model.get("merges") or []:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        joined = vocab.get(left + right)
        if joined is None or joined <= last:
            return None
        last = joined
    return ranks


def _encodes_alike(tokenizer: Tokenizer, fast: FastBPE, ranks: Mapping[bytes, int]) -> bool:
    samples = [_SAMPLE, *(f"{_SAMPLE}{special}{_SAMPLE}" for special in fast.encoding.special_tokens_set)]
    expected = tokenizer.encode_batch_fast(samples, add_special_tokens=False)
    for text, want in zip(samples, expected, strict=True):
        got = fast.encode(text)
        if got is not None and got != want.ids:
            return False
    alone: list[str] = []
    for token in ranks:
        try:
            alone.append(token.decode())
        except UnicodeDecodeError:  # part of a character: no text is this token alone
            continue
    expected = tokenizer.encode_batch_fast(alone, add_special_tokens=False)
    # No vocabulary token holds a byte the vocabulary lacks alone, nor (else HF would cut it
    # there, and this differ) an added token's text: the plain encode is the one to compare.
    encode = fast.encoding.encode_ordinary
    return all(encode(text) == want.ids for text, want in zip(alone, expected, strict=True))
