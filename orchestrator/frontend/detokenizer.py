"""Text out, one request at a time: token ids in as they stream, only the new text back.

`tokenizers.decoders.DecodeStream` does the hard part in Rust: it keeps a few tokens of
context, so a byte-level or byte-fallback token that ends halfway through a UTF-8 character
yields nothing until the character completes, and word-boundary markers (Metaspace's "▁",
ByteLevel's "Ġ") become spaces exactly as a full `decode` would make them. One call per delta,
whatever the number of tokens in it, keeps the per-token cost at a Rust call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from orchestrator.frontend.preprocessor import Preprocessor


class IncrementalDetokenizer:
    """Per-request state; not shared between requests or tasks."""

    __slots__ = ("_stream", "_tokenizer")

    def __init__(self, preprocessor: Preprocessor, skip_special_tokens: bool = True) -> None:
        self._tokenizer = preprocessor.tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_ids: Sequence[int]) -> str:
        """The text these tokens add to the output so far ("" while a character is incomplete)."""
        if not token_ids:
            return ""
        text = self._stream.step(self._tokenizer, list(token_ids))
        return text or ""
