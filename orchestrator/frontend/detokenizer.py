"""Text out, one request at a time: token ids in as they stream, only the new text back.

Two implementations of one contract: the streamed pieces join to exactly what a full
`tokenizer.decode` of the output gives, and a piece never ends halfway through a character.

- `ByteDetokenizer`, for byte-level BPE (GPT-2's alphabet: SmolLM2, Qwen, Llama 3, ...): a
  full decode is each token's bytes, concatenated, read as UTF-8 with U+FFFD for what is not.
  So each token's bytes are looked up once per model (`byte_table`) and a request's output is
  fed through an incremental UTF-8 decoder, which holds an unfinished character back and reads
  any chunking as one decode would. A delta then costs a list lookup, not a call into the
  tokenizer (prefix re-decoding, the byte alphabet's hash map), which cost about a sixth of
  a paced chunk's frontend CPU (docs/frontend.md, "Cost").
- `StreamDetokenizer`, for every other decoder (SentencePiece's Metaspace, byte fallback):
  `tokenizers.decoders.DecodeStream` keeps a few tokens of context in Rust, so a byte token
  that ends halfway through a UTF-8 character yields nothing until the character completes,
  and word-boundary markers ("▁") become spaces exactly as a full `decode` makes them.
  DecodeStream holds back a token whose bytes do not (yet) form valid UTF-8, with whatever text
  that token also carries; when the output ends there, the last step decodes the whole output
  once and emits what was held, with U+FFFD for the broken bytes, as a full decode does.
  One case differs: byte fallback turns every byte of a run of byte tokens that is not valid
  UTF-8 into U+FFFD, including a valid first part (a lone "<0x00>" before "<0x80>") that was
  already streamed; a model's real output does not hold such runs.
"""

from __future__ import annotations

import codecs
import random
from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream

# A load-time check that the byte table decodes as the tokenizer does, on this many seeded
# random outputs: a tokenizer.json whose byte-level setup differs in a way this module does not
# know falls back to DecodeStream instead of streaming wrong text.
_CHECK_SAMPLES = 256
_CHECK_LENGTH = 12


class Detokenizer(Protocol):
    """Per-request state; not shared between requests or tasks."""

    def step(self, token_ids: Sequence[int], final: bool = False) -> str:
        """The text these tokens add to the output so far ("" while a character is incomplete).
        With `final`, also whatever was held back for an unfinished character."""
        ...


class ByteDetokenizer:
    __slots__ = ("_decode", "_table")

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode

    def step(self, token_ids: Sequence[int], final: bool = False) -> str:
        table = self._table
        size = len(table)
        # Ids the vocabulary lacks decode to nothing, as in `tokenizer.decode`.
        if len(token_ids) == 1:
            token = token_ids[0]
            data = table[token] if 0 <= token < size else b""
        else:
            data = b"".join([table[t] for t in token_ids if 0 <= t < size])
        return str(self._decode(data, final))


class StreamDetokenizer:
    __slots__ = ("_emitted", "_ids", "_skip_special_tokens", "_stream", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted: list[str] = []  # the text returned so far, in pieces

    def step(self, token_ids: Sequence[int], final: bool = False) -> str:
        self._ids.extend(token_ids)
        text = (self._stream.step(self._tokenizer, list(token_ids)) or "") if token_ids else ""
        if final:
            emitted = "".join(self._emitted) + text
            full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)
            if full.startswith(emitted):
                text += full[len(emitted) :]
        self._emitted.append(text)
        return text


def _byte_alphabet_table() -> dict[int, str]:
    """GPT-2's byte-to-unicode map, inverted, as a `str.translate` table: each character a byte
    is written as -> that byte as a latin-1 character; every other character below 256 -> one
    latin-1 cannot encode (those above 256 it cannot encode anyway)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in chars)
    chars.update({byte: chr(256 + n) for n, byte in enumerate(shifted)})
    table = {code: "\uffff" for code in range(256)}
    table.update({ord(char): chr(byte) for byte, char in chars.items()})
    return table


_BYTE_ALPHABET = _byte_alphabet_table()


def byte_level_bytes(text: str) -> bytes | None:
    """The bytes a byte-level BPE token's text stands for; None if it holds a character
    outside GPT-2's byte alphabet."""
    try:
        return text.translate(_BYTE_ALPHABET).encode("latin-1")
    except UnicodeEncodeError:
        return None


def byte_tables(tokenizer: Tokenizer) -> dict[bool, list[bytes]] | None:
    """Each token id's bytes in a full decode, by `skip_special_tokens`; None unless the
    tokenizer's decoder is exactly ByteLevel and the tables decode a sample as it does."""
    if type(tokenizer.decoder) is not decoders.ByteLevel:
        return None
    table = [b""] * tokenizer.get_vocab_size(with_added_tokens=True)
    added = tokenizer.get_added_tokens_decoder()
    # Added tokens go through the decoder too; their ids may also be in the model's vocabulary.
    vocab = {**tokenizer.get_vocab(with_added_tokens=False), **{t.content: i for i, t in added.items()}}
    for text, token_id in vocab.items():
        # ByteLevel keeps a token with a character outside its alphabet as it is.
        data = byte_level_bytes(text)
        table[token_id] = text.encode() if data is None else data
    skipping = list(table)
    for token_id, token in added.items():
        if token.special:
            skipping[token_id] = b""
    tables = {False: table, True: skipping}
    if all(_decodes_alike(tokenizer, t, skip) for skip, t in tables.items()):
        return tables
    return None


def _decodes_alike(tokenizer: Tokenizer, table: list[bytes], skip_special_tokens: bool) -> bool:
    rng = random.Random(0)
    for _ in range(_CHECK_SAMPLES):
        ids = [rng.randrange(len(table)) for _ in range(_CHECK_LENGTH)]
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if b"".join(table[i] for i in ids).decode("utf-8", "replace") != expected:
            return False
    return True
