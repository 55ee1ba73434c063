"""A greedy completion streamed through the official openai client, as the end-to-end tests
compare them: its text, and the usage of its last chunk."""

from __future__ import annotations

import openai
from openai.types import CompletionUsage


def streamed_completion(
    client: openai.OpenAI, model: str, prompt: str, max_tokens: int, seed: int
) -> tuple[str, CompletionUsage, str | None]:
    """Greedy, `ignore_eos`, run to `max_tokens`: the text, the usage, the finish reason."""
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text: list[str] = []
    finish: str | None = None
    usage: CompletionUsage | None = None
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert usage is not None, "the stream ended without its usage"
    return "".join(text), usage, finish
