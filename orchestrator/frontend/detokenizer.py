"""Text out, one request at a time: token ids in as they stream, only the new text back.

`tokenizers.decoders.DecodeStream` does the hard part in Rust: it keeps a few tokens of
context, so a byte-level or byte-fallback token that ends halfway through a UTF-8 character
yields nothing until the character completes, and word-boundary markers (Metaspace's "▁",
ByteLevel's "Ġ") become spaces exactly as a full `decode` would make them. One call per delta,
whatever the number of tokens in it, keeps the per-token cost at a Rust call.

DecodeStream holds back a token whose bytes do not (yet) form valid UTF-8, with whatever
text that token also carries. When the output ends there, the last step decodes the whole
output once and emits what was held, with U+FFFD for the broken bytes, as a full decode does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from orchestrator.frontend.preprocessor import Preprocessor


class IncrementalDetokenizer:
    """Per-request state; not shared between requests or tasks."""

    __slots__ = ("_emitted", "_ids", "_skip_special_tokens", "_stream", "_tokenizer")

    def __init__(self, preprocessor: Preprocessor, skip_special_tokens: bool = True) -> None:
        self._tokenizer = preprocessor.tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted: list[str] = []  # the text returned so far, in pieces

    def step(self, token_ids: Sequence[int], final: bool = False) -> str:
        """The text these tokens add to the output so far ("" while a character is incomplete).
        With `final`, also whatever was held back for an unfinished character."""
        self._ids.extend(token_ids)
        text = (self._stream.step(self._tokenizer, list(token_ids)) or "") if token_ids else ""
        if final:
            emitted = "".join(self._emitted) + text
            full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)
            if full.startswith(emitted):
                text += full[len(emitted) :]
        self._emitted.append(text)
        return text
