"""SIGTERM to `weir serve --backend mocker` with 24 streams of 1,000 tokens (`ignore_eos`) in
flight: with a drain timeout long enough every stream completes (1,000 tokens, `[DONE]`); with
one too short every stream ends with an OpenAI error event and `[DONE]`, never a silent cut.
Prints one JSON line of figures per case."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.cli.procs import wait_healthy, weir_process
from tests.servers import free_port

pytestmark = pytest.mark.slow

STREAMS = 24
TOKENS = 1000


async def _streams(base_url: str, model: str, proc_signal: asyncio.Event) -> list[list[str]]:
    body = {"model": model, "prompt": "hello", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    started = 0
    all_started = asyncio.Event()

    async def one(client: httpx.AsyncClient) -> list[str]:
        nonlocal started
        events: list[str] = []
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:
                    started += 1
                    if started == STREAMS:
                        all_started.set()
                events.append(line[6:])
        return events

    limits = httpx.Limits(max_connections=STREAMS + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(one(client)) for _ in range(STREAMS)]
        await asyncio.wait_for(all_started.wait(), 60)
        proc_signal.set()
        return await asyncio.gather(*tasks)


@pytest.mark.parametrize(("speedup", "drain_timeout", "finish"), [(0.3, 60.0, True), (0.5, 1.0, False)])
def test_sigterm_drains_streams_or_ends_them_with_an_error(
    tmp_path: Path, speedup: float, drain_timeout: float, finish: bool
) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    args = [
        "serve", "--backend", "mocker", "--speedup", str(speedup), "--workers", "1",
        "--port", str(port), "--drain-timeout", str(drain_timeout),
    ]  # fmt: skip
    with weir_process(*args, log=log) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, proc, log)
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]

        async def run() -> tuple[list[list[str]], float]:
            streaming = asyncio.Event()
            task = asyncio.create_task(_streams(base_url, model, streaming))
            await streaming.wait()
            proc.send_signal(signal.SIGTERM)
            sent = time.perf_counter()
            results = await task
            return results, time.perf_counter() - sent

        results, ended_after = asyncio.run(run())
        proc.wait(timeout=30)  # it exits by itself once drained, before weir_process's SIGKILL

    completed = 0
    for events in results:
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        errors = [c["error"] for c in chunks if "error" in c]
        if finish:
            assert not errors
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            completed += 1
        else:
            assert len(errors) == 1 and "error" in chunks[-1], chunks[-1]
            assert errors[0]["code"] == "shutting_down"
            assert set(errors[0]) == {"message", "type", "param", "code"}
    assert ended_after < drain_timeout + 10
    if finish:  # streams outlived uvicorn's former fixed 5 s shutdown timeout, and completed
        assert ended_after > 5.0
    print(
        json.dumps(
            {
                "case": "finish" if finish else "cut",
                "streams": STREAMS,
                "tokens": TOKENS,
                "drain_timeout_s": drain_timeout,
                "completed": completed,
                "ended_with_error": STREAMS - completed,
                "last_stream_ended_s_after_sigterm": round(ended_after, 2),
            }
        )
    )
