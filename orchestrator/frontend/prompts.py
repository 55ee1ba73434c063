"""Prompt text -> token ids without stalling the event loop.

Tokenizing is the one step whose cost grows with client input (about 1.7 us per byte: a 10 MB
body is seconds of CPU). Two guards keep one huge prompt from holding up everyone else: a
prompt too long to fit the context whatever its tokens is rejected before tokenizing, and a
long one is tokenized in a worker thread (`Preprocessor.encode` releases the GIL)."""

from __future__ import annotations

import asyncio

from orchestrator.frontend.errors import InvalidRequest
from orchestrator.frontend.preprocessor import Preprocessor

# Below this many characters, a thread hop costs more than tokenizing in place.
OFFLOAD_CHARS = 16_384
# Normalizers may shrink text (NFKC folds some 3-byte characters into 2), so the bound keeps slack.
_SLACK = 4


def max_prompt_chars(pre: Preprocessor, context_length: int) -> int:
    """No text longer than this fits `context_length` tokens: no token covers more bytes than
    the longest vocabulary entry, and a character is at least one byte."""
    longest = max((len(token.encode()) for token in pre.tokenizer.get_vocab()), default=1)
    return context_length * longest * _SLACK


async def encode(
    pre: Preprocessor, text: str, add_special_tokens: bool, max_chars: int, param: str
) -> list[int]:
    if len(text) > max_chars:
        raise InvalidRequest(
            f"The prompt ({len(text)} characters) cannot fit this model's context.",
            param=param,
            code="context_length_exceeded",
        )
    if len(text) < OFFLOAD_CHARS:
        return pre.encode(text, add_special_tokens)
    return await asyncio.to_thread(pre.encode, text, add_special_tokens)


async def completion_prompts(
    pre: Preprocessor, prompt: str | list[int] | list[str] | list[list[int]], max_chars: int
) -> list[list[int]]:
    """A completion prompt in any of OpenAI's four shapes, as token id lists."""
    if isinstance(prompt, str):
        return [await encode(pre, prompt, True, max_chars, "prompt")]
    if all(isinstance(p, int) for p in prompt):
        batch: list[list[int]] = [prompt]  # type: ignore[list-item]
    elif all(isinstance(p, str) for p in prompt):
        return [await encode(pre, p, True, max_chars, "prompt") for p in prompt]  # type: ignore[arg-type]
    else:
        batch = prompt  # type: ignore[assignment]
    for ids in batch:
        if any(not 0 <= t < pre.vocab_size for t in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {pre.vocab_size})", param="prompt")
    return batch
