"""SIGTERM to `weir serve --backend mocker` with a non-streaming completion in flight that
outlives `--drain-timeout`: the client gets 503 in OpenAI's error shape (`shutting_down`), not a
dropped connection, and the server exits by itself."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from tests.cli.procs import wait_healthy, weir_process
from tests.servers import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

DRAIN_TIMEOUT_S = 1.0


def test_a_unary_request_cut_by_the_drain_gets_503(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    args = [
        "serve", "--backend", "mocker", "--speedup", "0.2", "--workers", "1",
        "--port", str(port), "--drain-timeout", str(DRAIN_TIMEOUT_S),
    ]  # fmt: skip
    with weir_process(*args, log=log) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, proc, log)
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        # 2,000 tokens at a fifth of the simulated speed: far longer than the drain timeout.
        body = {"model": model, "prompt": "hello", "max_tokens": 2000, "ignore_eos": True}

        async def run() -> tuple[httpx.Response, float]:
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                long = asyncio.create_task(client.post("/v1/completions", json=body))

                async def in_flight() -> bool:
                    text = (await client.get("/metrics")).text
                    return any(
                        line.startswith('weir_frontend_inflight_requests{endpoint="completions"}')
                        and not line.endswith(" 0.0")
                        for line in text.splitlines()
                    )

                async def wait_in_flight() -> None:
                    while not await in_flight():
                        await asyncio.wait([long], timeout=0.02)
                        assert not long.done(), long.result().text

                await asyncio.wait_for(wait_in_flight(), 30)
                proc.send_signal(signal.SIGTERM)
                loop = asyncio.get_running_loop()
                sent = loop.time()
                response = await long
                return response, loop.time() - sent

        response, ended_after = asyncio.run(run())
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "shutting_down"
        assert error["type"] == "service_unavailable_error"
        assert DRAIN_TIMEOUT_S * 0.9 <= ended_after < DRAIN_TIMEOUT_S + 10
        wait_until(lambda: proc.poll() is not None, "the server to exit after its drain", 30)
        assert proc.returncode == 0, log.read_text()[-2000:]
