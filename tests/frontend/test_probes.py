"""The probe port (probes.py): answered by a thread while the event loop is busy, and failing
once the loop has been stuck for longer than the stall bound."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from orchestrator.frontend import probes
from orchestrator.frontend.probes import ProbeServer


def _get(url: str, out: list[tuple[int, str, float]]) -> None:
    started = time.perf_counter()
    reply = httpx.get(url, timeout=5)
    out.append((reply.status_code, reply.text, time.perf_counter() - started))


async def _with_server(scenario: object) -> None:
    server = ProbeServer("127.0.0.1", 0, {"/health": lambda: (200, b'{"status":"ok"}')})
    server.start()
    try:
        await scenario(f"http://127.0.0.1:{server.port}")  # type: ignore[operator]
    finally:
        await server.stop()


def test_probes_answer_while_the_event_loop_is_busy() -> None:
    async def scenario(base: str) -> None:
        answers: list[tuple[int, str, float]] = []
        await asyncio.to_thread(_get, f"{base}/health", answers)
        await asyncio.to_thread(_get, f"{base}/nope", answers)
        assert [a[:2] for a in answers] == [(200, '{"status":"ok"}'), (404, '{"status":"not found"}')]
        # The loop is busy (a burst of requests, simulated by blocking it) for a second: the
        # probe is answered long before it ends.
        during: list[tuple[int, str, float]] = []
        prober = threading.Thread(target=_get, args=(f"{base}/health", during))
        prober.start()
        time.sleep(1.0)
        prober.join(5)
        assert during and during[0][0] == 200 and during[0][2] < 0.5, during

    asyncio.run(_with_server(scenario))


def test_a_stuck_event_loop_fails_the_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes, "STALL_S", 0.3)

    async def scenario(base: str) -> None:
        await asyncio.sleep(0)  # the heartbeat task has run once
        time.sleep(0.6)  # the loop stops stamping: stuck past the bound
        stuck: list[tuple[int, str, float]] = []
        _get(f"{base}/health", stuck)
        assert stuck[0][:2] == (503, '{"status":"event loop stalled"}')
        # Running again: the next beat clears it.
        recovered: list[tuple[int, str, float]] = []
        deadline = time.monotonic() + 5
        while not (recovered and recovered[-1][0] == 200) and time.monotonic() < deadline:
            await asyncio.to_thread(_get, f"{base}/health", recovered)
        assert recovered[-1][0] == 200

    asyncio.run(_with_server(scenario))
