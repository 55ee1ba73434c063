"""Admission control over real HTTP: with every worker busy a request waits in its model's
bounded queue, is admitted when a request finishes, and gets 429 with Retry-After (the openai
client's RateLimitError) when the queue is full or its wait runs out. Also: a stream that
fails after its 200 is counted by its error, not as a success."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from orchestrator.frontend.config import FrontendConfig
from tests.frontend.live_frontend import MODEL, LiveFrontend, live_frontend
from tests.frontend.tokenizer_dirs import build_chatml

QUEUE_WAIT_S = 2.0
# Any prompt block in use makes the worker busy: one long stream occupies it.
BUSY_AT_ONCE = 1e-9


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFrontend]:
    with live_frontend(
        build_chatml(tmp_path_factory.mktemp("chatml")),
        num_workers=1,
        speedup=0.02,  # a slow mocker: a long stream stays in flight until it is closed
        active_decode_blocks_threshold=BUSY_AT_ONCE,
        max_queued_requests=1,
        max_queue_wait_s=QUEUE_WAIT_S,
    ) as frontend:
        yield frontend


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m and all(part in m.group(1) for part in want.split(",")):
            return float(m.group(2))
    return 0.0


async def _metrics(client: httpx.AsyncClient) -> str:
    return (await client.get("/metrics")).text


async def _wait_queued(client: httpx.AsyncClient, count: int) -> None:
    """Until the model's queue gauge shows `count` waiting requests (10 s at most)."""
    for _ in range(1000):
        if _metric(await _metrics(client), "weir_frontend_queued_requests", model=MODEL) == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the queue never held {count} requests")


async def _occupy(client: httpx.AsyncClient, stack: contextlib.AsyncExitStack) -> None:
    """Open a long stream and read its first chunk: the worker is busy from then on."""
    response = await stack.enter_async_context(
        client.stream("POST", "/v1/completions", json=_body(4000, True))
    )
    assert response.status_code == 200
    chunks = response.aiter_bytes()
    await anext(chunks)
    # Held until the stack closes: a dropped iterator is finalised, and that closes the stream.
    stack.push_async_callback(chunks.aclose)


def test_full_queue_and_long_wait_get_429_and_a_finished_request_admits_the_next(live: LiveFrontend) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            before = await _metrics(client)
            stack = contextlib.AsyncExitStack()
            async with stack:
                await _occupy(client, stack)
                waiting = asyncio.create_task(client.post("/v1/completions", json=_body(2, False)))
                await _wait_queued(client, 1)
                full = await client.post("/v1/completions", json=_body(2, False))
                assert full.status_code == 429
                assert full.headers["retry-after"] == "1"
                error = full.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["code"] == "rate_limit_exceeded"
                assert not waiting.done()
            # The long stream is closed: its blocks are released and the queued one runs.
            admitted = await waiting
            assert admitted.status_code == 200, admitted.text
            assert admitted.json()["usage"]["completion_tokens"] == 2

            async with contextlib.AsyncExitStack() as stack:
                await _occupy(client, stack)
                loop = asyncio.get_running_loop()
                started = loop.time()
                late = await client.post("/v1/completions", json=_body(2, False))
                waited = loop.time() - started
                assert late.status_code == 429
                assert late.headers["retry-after"] == "1"
                assert waited >= QUEUE_WAIT_S * 0.9

            after = await _metrics(client)
            for reason in ("queue_full", "queue_timeout"):
                key = {"model": MODEL, "reason": reason}
                grown = _metric(after, "weir_frontend_rejected_requests_total", **key) - _metric(
                    before, "weir_frontend_rejected_requests_total", **key
                )
                assert grown == 1, reason
            waits = _metric(after, "weir_frontend_queue_wait_seconds_count", model=MODEL) - _metric(
                before, "weir_frontend_queue_wait_seconds_count", model=MODEL
            )
            assert waits == 3  # the two streams and the one admitted from the queue
            assert _metric(after, "weir_frontend_queued_requests", model=MODEL) == 0
            rejected = _metric(after, "weir_frontend_requests_total", endpoint="completions", status="429")
            assert (
                rejected
                - _metric(before, "weir_frontend_requests_total", endpoint="completions", status="429")
                == 2
            )

    asyncio.run(scenario())


def test_openai_client_sees_rate_limit_error(live: LiveFrontend) -> None:
    async def scenario() -> None:
        async with (
            httpx.AsyncClient(base_url=live.url, timeout=30) as client,
            contextlib.AsyncExitStack() as stack,
        ):
            await _occupy(client, stack)
            sdk = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
            queued = asyncio.create_task(sdk.completions.create(model=MODEL, prompt="hi", max_tokens=1))
            await _wait_queued(client, 1)
            with pytest.raises(openai.RateLimitError) as caught:
                await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            assert caught.value.status_code == 429
            assert caught.value.response.headers["retry-after"] == "1"
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            await sdk.close()

    asyncio.run(scenario())


def test_thresholds_are_off_by_default() -> None:
    config = FrontendConfig()
    assert config.active_decode_blocks_threshold is None
    assert config.active_prefill_tokens_threshold is None
    with pytest.raises(ValueError):
        FrontendConfig(active_decode_blocks_threshold=1.5)
    with pytest.raises(ValueError):
        FrontendConfig(active_prefill_tokens_threshold=0)


def test_a_stream_that_fails_midway_is_counted_by_its_error(tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = build_chatml(tmp_path_factory.mktemp("chatml-timeout"))
    with live_frontend(model_dir, num_workers=1, speedup=1.0, request_timeout_s=1.0) as frontend:
        with httpx.stream(
            "POST", f"{frontend.url}/v1/completions", json=_body(4000, True), timeout=30
        ) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert '"type":"timeout_error"' in events[-2]
        text = httpx.get(f"{frontend.url}/metrics").text
        assert _metric(text, "weir_frontend_requests_total", endpoint="completions", status="504") == 1
        assert _metric(text, "weir_frontend_requests_total", endpoint="completions", status="200") == 0
        assert _metric(text, "weir_frontend_errors_total", type="timeout_error") == 1
