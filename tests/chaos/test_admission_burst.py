"""Admission thresholds on `weir serve --backend mocker`, end to end: a burst of long-prompt
requests against a low `--active-prefill-tokens-threshold` (the worker's reported prompt tokens
waiting for prefill) or `--active-decode-blocks-threshold` (the router's KV blocks in use) waits
in the admission queue (the frontend's queued gauge rises, queue waits are observed) and every
request completes; with `--max-queued-requests 1` the overflow gets 429 with Retry-After in
OpenAI's error shape, counted as `queue_full`."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from tests.cli.procs import wait_healthy, weir_process
from tests.servers import free_port

pytestmark = pytest.mark.slow

BURST = 12
PROMPT = " ".join(f"w{i}" for i in range(600))  # several hundred tokens: one is over either threshold
THRESHOLDS = {
    # Small engine steps: each prompt's prefill spans many, reported as tokens still queued.
    "prefill": ["--active-prefill-tokens-threshold", "64", "--max-num-batched-tokens", "64"],
    "decode": ["--active-decode-blocks-threshold", "0.02", "--num-blocks", "2048"],
}


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _smallest_bucket(text: str, model: str) -> float:
    """The count in the queue wait histogram's smallest bucket."""
    buckets = []
    for line in text.splitlines():
        if line.startswith("weir_frontend_queue_wait_seconds_bucket{") and f'model="{model}"' in line:
            le = re.search(r'le="([^"]+)"', line)
            assert le is not None
            buckets.append((float(le.group(1)), float(line.rsplit(" ", 1)[1])))
    assert buckets
    return min(buckets)[1]


async def _burst(base_url: str, model: str) -> tuple[list[httpx.Response], float]:
    """BURST completions, one more sent after each look at /metrics (a prefill backlog shows in
    the frontend only with the worker's next load report, so requests sent within the same
    millisecond are all admitted on the idle view); also the most requests seen queued at once."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    peak = 0.0
    async with httpx.AsyncClient(base_url=base_url, timeout=90) as client:
        tasks: list[asyncio.Task[httpx.Response]] = []
        while len(tasks) < BURST or not all(t.done() for t in tasks):
            if len(tasks) < BURST:
                tasks.append(asyncio.create_task(client.post("/v1/completions", json=body)))
            text = (await client.get("/metrics")).text
            peak = max(peak, _metric(text, "weir_frontend_queued_requests", model=model))
            await asyncio.wait(tasks, timeout=0.02, return_when=asyncio.FIRST_COMPLETED)
        return [t.result() for t in tasks], peak


def _serve(tmp_path: Path, threshold: str, max_queued: int) -> tuple[list[str], Path, int]:
    port = free_port()
    args = [
        "serve", "--backend", "mocker", "--speedup", "0.2", "--workers", "1", "--port", str(port),
        *THRESHOLDS[threshold], "--max-queued-requests", str(max_queued), "--max-queue-wait", "60",
    ]  # fmt: skip
    return args, tmp_path / "serve.log", port


@pytest.mark.parametrize("threshold", sorted(THRESHOLDS))
def test_a_burst_over_the_threshold_waits_in_the_queue_and_completes(tmp_path: Path, threshold: str) -> None:
    args, log, port = _serve(tmp_path, threshold, max_queued=100)
    with weir_process(*args, log=log) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, proc, log)
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        responses, peak = asyncio.run(_burst(base_url, model))
        assert [r.status_code for r in responses] == [200] * BURST, [r.text for r in responses]
        assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        assert peak >= 1, "no request ever waited for admission"
        assert _metric(text, "weir_frontend_queued_requests", model=model) == 0
        assert _metric(text, "weir_frontend_queue_wait_seconds_count", model=model) == BURST
        # Some admission waited longer than the smallest bucket: the queue held it.
        assert _smallest_bucket(text, model) < BURST
        assert _metric(text, "weir_frontend_rejected_requests_total", model=model) == 0


@pytest.mark.parametrize("threshold", sorted(THRESHOLDS))
def test_a_burst_past_a_small_queue_gets_429_with_retry_after(tmp_path: Path, threshold: str) -> None:
    args, log, port = _serve(tmp_path, threshold, max_queued=1)
    with weir_process(*args, log=log) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, proc, log)
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        responses, _ = asyncio.run(_burst(base_url, model))
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) == {200, 429}, statuses
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["code"] == "rate_limit_exceeded"
                assert error["type"] == "requests"
            else:
                assert r.json()["usage"]["completion_tokens"] == 8
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        rejected = statuses.count(429)
        assert (
            _metric(text, "weir_frontend_rejected_requests_total", model=model, reason="queue_full")
            == rejected
        )
        assert _metric(text, "weir_frontend_queued_requests", model=model) == 0
