"""The frontend in front of a real engine (DeepInfer on a tiny random-weight Llama, CPU):
logprobs in both OpenAI formats, and guided decoding reaching the sampler."""

from __future__ import annotations

import re
from collections.abc import Iterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends.deepinfer.config import EngineConfig
from backends.deepinfer.tiny import build_checkpoint
from backends.deepinfer.worker import DeepInferWorker
from tests.frontend.live_frontend import MODEL, live_frontend

# Loads torch and a model: seconds, not milliseconds.
pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model_dir = build_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    config = EngineConfig(model=str(model_dir), served_model_name=MODEL, device="cpu", num_kv_blocks=128)
    with live_frontend(model_dir, num_workers=1, engine_factory=lambda: DeepInferWorker(config)) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_logprobs_with_top_alternatives(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == out.usage.completion_tokens == 6
    for entry in logprobs.content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())

    # Token texts add up to the content, except that a token holding part of a multi-byte
    # character reads as U+FFFD on its own: compare the ASCII characters.
    def ascii_only(text: str) -> str:
        return "".join(c for c in text if c.isascii())

    joined = "".join(e.token for e in logprobs.content)
    assert ascii_only(joined) == ascii_only(out.choices[0].message.content or "")


def test_completion_logprobs_streamed(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=5,
        logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in stream:
        logprobs = chunk.choices[0].logprobs
        if logprobs is not None and logprobs.tokens is not None:
            tokens += logprobs.tokens
            offsets += logprobs.text_offset or []
            assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs or [])
    assert len(tokens) == 5
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_guided_choice_and_regex_reach_the_sampler(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, extra_body={"guided_choice": ["Paris", "London"]}
    )
    assert choice.choices[0].message.content in ("Paris", "London")
    regex = client.completions.create(
        model=MODEL, prompt="A number:", max_tokens=10, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert re.fullmatch("[0-9]{3}", regex.choices[0].text)
