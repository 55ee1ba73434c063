"""A worker that has begun to drain refuses new requests with `overloaded` (worker_host.py),
and the frontend migrates them to another worker. The window is real: `WorkerHost.drain` sets
its flag before its `draining=True` record reaches the frontend's discovery, so the router may
still place requests there. Only the pre-first-token case exists: a request that already streams
is never refused (draining lets in-flight requests finish), so `overloaded` cannot arrive
mid-stream."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.frontend.live_frontend import MODEL, live_frontend
from tests.frontend.tokenizer_dirs import build_chatml


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chatml(tmp_path_factory.mktemp("chatml"))


def _metric(url: str, line_start: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


@pytest.mark.parametrize("migration_limit", [0, 3])
def test_a_request_refused_as_overloaded_migrates(model_dir: Path, migration_limit: int) -> None:
    with live_frontend(
        model_dir, num_workers=2, router_mode="round-robin", migration_limit=migration_limit
    ) as live:
        refusing = sorted(live.hosts)[0]
        host = live.hosts[refusing]

        async def begin_drain() -> None:  # drain's first step, before discovery hears of it
            host.draining = True

        live.call(begin_drain)
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)
        outcomes: list[object] = []
        for _ in range(4):  # round-robin sends every other one to the refusing worker
            try:
                out = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
                assert out.usage is not None and out.usage.completion_tokens == 3
                outcomes.append("ok")
            except openai.APIStatusError as exc:
                outcomes.append(exc.status_code)
                assert exc.body is not None
        migrated = _metric(live.url, 'weir_frontend_migrations_total{model="mock-model",reason="overloaded"}')
        if migration_limit == 0:
            assert sorted(outcomes, key=str) == [503, 503, "ok", "ok"]
            assert migrated == 0
        else:
            assert outcomes == ["ok"] * 4
            assert migrated >= 1
        # A refusal is not a lost connection: the worker's breaker stays closed.
        assert _metric(live.url, "weir_frontend_circuit_breaker_trips_total{") == 0
