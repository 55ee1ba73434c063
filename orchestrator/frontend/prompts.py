"""Prompts -> token ids without stalling the event loop.

Rendering the chat template and tokenizing are the steps whose cost grows with client input
(tokenizing is about 1.7 us per byte: a 10 MB body is seconds of CPU). Three guards keep one
huge request from holding up everyone else: a prompt too long to fit the context whatever its
tokens is rejected before tokenizing; long prompts (or many short ones) are tokenized in a
worker thread (`Preprocessor.encode` releases the GIL); and a large conversation is rendered
in a worker thread too, where pure-Python template code yields the GIL every few milliseconds."""

from __future__ import annotations

import asyncio
from typing import Any

from orchestrator.frontend.errors import InvalidRequest
from orchestrator.frontend.preprocessor import Preprocessor
from orchestrator.frontend.protocol import ChatCompletionRequest

# Template variables the request sets itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools"})

# Below this many characters, a thread hop costs more than tokenizing in place.
OFFLOAD_CHARS = 16_384
# Normalizers may shrink text (NFKC folds some 3-byte characters into 2), so the bound keeps slack.
_SLACK = 4


def max_prompt_chars(pre: Preprocessor, context_length: int) -> int:
    """No text longer than this fits `context_length` tokens: no token covers more bytes than
    the longest vocabulary entry, and a character is at least one byte."""
    longest = max((len(token.encode()) for token in pre.tokenizer.get_vocab()), default=1)
    return context_length * longest * _SLACK


def _check_fits(text: str, max_chars: int, param: str = "prompt") -> None:
    if len(text) > max_chars:
        raise InvalidRequest(
            f"The prompt ({len(text)} characters) cannot fit this model's context.",
            param=param,
            code="context_length_exceeded",
        )


async def encode(
    pre: Preprocessor, text: str, add_special_tokens: bool, max_chars: int, param: str
) -> list[int]:
    _check_fits(text, max_chars, param)
    if len(text) < OFFLOAD_CHARS:
        return pre.encode(text, add_special_tokens)
    return await asyncio.to_thread(pre.encode, text, add_special_tokens)


async def chat_prompt(pre: Preprocessor, req: ChatCompletionRequest, offload: bool) -> str:
    """The request's prompt text; InvalidRequest for anything the template cannot take."""
    kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields do",
            param="chat_template_kwargs",
        )
    if req.tools:
        kwargs["tools"] = req.tools

    def render() -> str:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        return pre.render_chat(messages, req.add_generation_prompt, **kwargs)

    try:
        return await asyncio.to_thread(render) if offload else render()
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="messages") from exc


def prompt_count(prompt: str | list[int] | list[str] | list[list[int]]) -> int:
    """How many prompts a completion request holds (validated: a list is of one kind)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


async def completion_prompts(
    pre: Preprocessor, prompt: str | list[int] | list[str] | list[list[int]], max_chars: int
) -> list[list[int]]:
    """A completion prompt in any of OpenAI's four shapes, as token id lists."""
    if isinstance(prompt, str):
        return [await encode(pre, prompt, True, max_chars, "prompt")]
    if isinstance(prompt[0], int):
        batch: list[list[int]] = [prompt]
    elif isinstance(prompt[0], str):
        texts: list[str] = prompt
        for text in texts:
            _check_fits(text, max_chars)
        if sum(map(len, texts)) < OFFLOAD_CHARS:
            return [pre.encode(text, True) for text in texts]
        return await asyncio.to_thread(lambda: [pre.encode(text, True) for text in texts])
    else:
        batch = prompt
    for ids in batch:
        # min and max run in C: a prompt of a million ids costs milliseconds, not a Python loop.
        if ids and (min(ids) < 0 or max(ids) >= pre.vocab_size):
            raise InvalidRequest(f"prompt token ids must be in [0, {pre.vocab_size})", param="prompt")
    return batch
