"""The OpenAI API over a real socket, through the official `openai` client, against mocker workers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.frontend.live_frontend import MODEL, LiveFrontend, live_frontend
from tests.frontend.tokenizer_dirs import build_chatml

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Say hello to the quick brown fox."}
]
FIXED = {"ignore_eos": True}  # the mocker may sample an end token; these tests want exact lengths


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chatml(tmp_path_factory.mktemp("chatml"))


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[LiveFrontend]:
    with live_frontend(model_dir, num_workers=2, router_mode="round-robin") as frontend:
        yield frontend


@pytest.fixture
def client(live: LiveFrontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_lists_the_workers_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=FIXED)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens > 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_streaming_matches_non_streaming_for_a_seed(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 12,
        "seed": 7,
        "extra_body": FIXED,
    }
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_prompts(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="The quick brown", max_tokens=6, seed=3, extra_body=FIXED
    )
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 6
    streamed = client.completions.create(
        model=MODEL, prompt="The quick brown", max_tokens=6, seed=3, stream=True, extra_body=FIXED
    )
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, extra_body=FIXED)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 4


def test_n_choices_are_seeded_per_choice(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, n=3, seed=11, extra_body=FIXED
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage is not None and out.usage.completion_tokens == 24
    again = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, n=3, seed=11, extra_body=FIXED
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    streamed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, n=3, seed=11, stream=True, extra_body=FIXED
    )
    texts = ["", "", ""]
    chunk: Any
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in out.choices]


def test_stop_string_cuts_the_output(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 40,
        "seed": 5,
        "extra_body": FIXED,
    }
    full = client.chat.completions.create(**args).choices[0].message.content
    assert full is not None and len(full) > 10
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    out = client.chat.completions.create(**args, stop=[stop, "never-seen-stop"])
    assert out.choices[0].message.content == expected
    assert out.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(**args, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    kept = client.chat.completions.create(
        **{**args, "extra_body": {**FIXED, "include_stop_str_in_output": True}}, stop=stop
    )
    assert kept.choices[0].message.content == expected + stop


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    long_prompt = "An inference server turns prompts into tokens and streams the answer back. " * 20
    cached: list[int | None] = []
    # Round-robin over two workers: the first and third requests land on the same worker.
    for _ in range(3):
        out = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, extra_body=FIXED)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0
    assert (cached[2] or 0) >= 64  # at least one full block of the prompt


def test_kv_router_sends_a_repeated_prompt_where_it_is_cached(model_dir: Path) -> None:
    with live_frontend(model_dir, num_workers=2, router_mode="kv") as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)
        prompt = "A paged key-value cache stores attention state in fixed-size blocks. " * 20
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=FIXED)
        second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=FIXED)
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= 64
