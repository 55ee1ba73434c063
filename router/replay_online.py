"""Online trace replay: the trace's requests sent in real time to a running frontend.

Each request is an OpenAI streaming completion whose prompt is the trace's synthetic token
ids (`ignore_eos`, `max_tokens` = the trace's output length), sent at its timestamp divided
by `speedup`. TTFT is the first chunk that carries output, the hit rate comes from the
final usage's `prompt_tokens_details.cached_tokens`. Which worker served a request is the
frontend's business, so the per-worker spread is not reported here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import httpx
import msgspec

from router.replay import RequestRecord, TraceRequest, TraceTokens


class _Details(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Choice(msgspec.Struct):
    text: str = ""


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def replay_online(
    url: str,
    trace: Sequence[TraceRequest],
    tokens: TraceTokens,
    model: str | None,
    speedup: float = 1.0,
    on_finish: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Replay `trace` against the frontend at `url`; `on_finish` hears of each request once,
    when it finishes or fails."""
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        if model is None:
            listing = await client.get("/v1/models")
            listing.raise_for_status()
            model = str(listing.json()["data"][0]["id"])
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def send(request: TraceRequest) -> RequestRecord:
            record = await _send(client, model, request, tokens, start)
            if on_finish is not None:
                on_finish(record)
            return record

        first_ms = trace[0].timestamp_ms if trace else 0.0
        tasks: list[asyncio.Task[RequestRecord]] = []
        for request in trace:
            delay = (request.timestamp_ms - first_ms) / speedup / 1e3 - (loop.time() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(request)))
        return list(await asyncio.gather(*tasks))


async def _send(
    client: httpx.AsyncClient, model: str, request: TraceRequest, tokens: TraceTokens, start: float
) -> RequestRecord:
    loop = asyncio.get_running_loop()

    def now_ms() -> float:
        return (loop.time() - start) * 1e3

    record = RequestRecord(arrival_ms=now_ms(), prompt_tokens=request.input_length)
    body = {
        "model": model,
        "prompt": tokens.prompt(request),
        "max_tokens": request.output_length,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = _decode_chunk(line[6:])
                if record.first_token_ms is None and any(c.text for c in chunk.choices):
                    record.first_token_ms = now_ms()
                if chunk.usage is not None:
                    record.output_tokens = chunk.usage.completion_tokens
                    details = chunk.usage.prompt_tokens_details
                    record.cached_tokens = details.cached_tokens if details else 0
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.finish_ms = now_ms()
    if record.first_token_ms is None:  # every token decoded to empty text: count the end
        record.first_token_ms = record.finish_ms
    return record
