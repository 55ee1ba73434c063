"""Workers coming and going, retries, client disconnects, /health and /metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from openai.types.chat import ChatCompletionMessageParam

from orchestrator.frontend.config import FrontendConfig
from orchestrator.frontend.registry import ModelRegistry
from orchestrator.frontend.server import create_app, uvicorn_config
from orchestrator.runtime.discovery import MemoryDiscovery
from orchestrator.runtime.protocol import Instance, ModelCard
from orchestrator.runtime.worker_host import WorkerHost
from tests.frontend.live_frontend import MODEL, LiveFrontend, live_frontend, mocker_factory
from tests.frontend.tokenizer_dirs import build_chatml
from tests.servers import free_port
from tests.waiting import wait_until

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chatml(tmp_path_factory.mktemp("chatml"))


def _client(live: LiveFrontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _metric(live: LiveFrontend, line_start: str) -> float:
    text = httpx.get(f"{live.url}/metrics").text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    return sum(values)


def test_client_disconnect_cancels_on_the_worker(model_dir: Path) -> None:
    # Real-time mocker (speedup 1): 2,000 tokens take many seconds, so only a cancel ends it early.
    with live_frontend(model_dir, num_workers=1, speedup=1.0) as live:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert live.active_requests() == 1
        wait_until(lambda: live.active_requests() == 0)
        wait_until(lambda: _metric(live, "weir_frontend_client_disconnects_total") == 1)
        # A non-streaming request whose client gives up is cancelled the same way.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/chat/completions", json={**body, "stream": False}, timeout=1.0)
        wait_until(lambda: live.active_requests() == 0)
        wait_until(lambda: _metric(live, "weir_frontend_client_disconnects_total") == 2)


def test_health_follows_workers_and_models_follow_discovery(model_dir: Path) -> None:
    with live_frontend(model_dir, num_workers=1) as live:
        assert httpx.get(f"{live.url}/live").status_code == 200
        assert httpx.get(f"{live.url}/health").json()["workers"] == 1
        (worker_id,) = live.engines
        live.call(lambda: live.discovery.deregister(worker_id))
        wait_until(lambda: httpx.get(f"{live.url}/health").status_code == 503)
        assert _client(live).models.list().data == []
        with pytest.raises(openai.NotFoundError):
            _client(live).chat.completions.create(model=MODEL, messages=MESSAGES)
        card = live.engines[worker_id].card
        live.call(
            lambda: live.discovery.register(Instance(instance_id=worker_id, component="worker", card=card))
        )
        wait_until(lambda: httpx.get(f"{live.url}/health").status_code == 200)
        assert httpx.get(f"{live.url}/live").status_code == 200
        out = _client(live).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert out.choices


@pytest.mark.parametrize("migration_limit", [3, 0])
def test_unreachable_worker_is_retried_on_another(model_dir: Path, migration_limit: int) -> None:
    with live_frontend(
        model_dir, num_workers=1, router_mode="round-robin", migration_limit=migration_limit
    ) as live:
        (worker_id,) = live.engines
        card: ModelCard = live.engines[worker_id].card
        # A worker registered at a port nothing listens on: its connection fails, retryably.
        ghost = Instance(
            instance_id="a-ghost", component="worker", address=f"127.0.0.1:{free_port()}", card=card
        )
        live.call(lambda: live.discovery.register(ghost))
        wait_until(lambda: httpx.get(f"{live.url}/health").json()["workers"] == 2)
        client = _client(live)
        if migration_limit == 0:  # no migration: whoever the ghost gets fails
            outcomes = []
            for _ in range(2):  # round-robin sends one of the two to the ghost
                try:
                    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
                    outcomes.append("ok")
                except openai.APIStatusError as exc:
                    outcomes.append(exc.status_code)
            assert sorted(outcomes, key=str) == [503, "ok"]
            assert _metric(live, "weir_frontend_migrations_total{") == 0
            return
        for _ in range(4):  # round-robin would send every other one to the ghost
            out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
            assert out.choices[0].finish_reason in ("length", "stop")
        # Its refused connection trips its breaker: later requests do not try it first.
        assert _metric(live, 'weir_frontend_migrations_total{model="mock-model",reason="unavailable"}') >= 1
        trips = _metric(live, "weir_frontend_circuit_breaker_trips_total{")
        assert 1 <= trips <= _metric(live, "weir_frontend_migrations_total{")


def test_metrics_count_requests_tokens_and_latency(model_dir: Path) -> None:
    with live_frontend(model_dir, num_workers=1) as live:
        client = _client(live)
        stream: Any = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, extra_body={"ignore_eos": True}
        )
        assert len([c for c in stream if c.choices]) >= 1
        client.completions.create(model=MODEL, prompt="hello", max_tokens=3, extra_body={"ignore_eos": True})
        httpx.post(f"{live.url}/v1/completions", content=b"{", timeout=10)
        assert _metric(live, 'weir_frontend_requests_total{endpoint="chat",status="200"}') == 1
        assert _metric(live, 'weir_frontend_requests_total{endpoint="completions",status="200"}') == 1
        assert _metric(live, 'weir_frontend_requests_total{endpoint="completions",status="400"}') == 1
        assert _metric(live, 'weir_frontend_errors_total{type="invalid_request_error"}') == 1
        assert _metric(live, f'weir_frontend_output_tokens_total{{model="{MODEL}"}}') == 8
        assert _metric(live, f'weir_frontend_input_tokens_total{{model="{MODEL}"}}') > 0
        assert _metric(live, f'weir_frontend_time_to_first_token_seconds_count{{model="{MODEL}"}}') == 2
        assert _metric(live, f'weir_frontend_inter_token_latency_seconds_count{{model="{MODEL}"}}') == 2
        assert _metric(live, 'weir_frontend_inflight_requests{endpoint="chat"}') == 0
        assert _metric(live, "weir_frontend_workers") == 1
        assert _metric(live, f'weir_router_decisions_total{{mode="kv",model="{MODEL}"}}') == 2


def test_many_streams_with_hang_ups_leave_nothing_behind(model_dir: Path) -> None:
    with live_frontend(model_dir, num_workers=2, speedup=5.0) as live:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1000, "stream": True, "ignore_eos": True}
        # Streams that hang up are long (about four seconds of simulated decode), so that a
        # client reading its first chunk late on a loaded machine still hangs up mid-stream:
        # at 1,000 tokens all twenty once finished first.
        long_body = {**body, "max_tokens": 4000}

        async def one(client: httpx.AsyncClient, hang_up: bool) -> bool:
            sent = long_body if hang_up else body
            async with client.stream("POST", f"{live.url}/v1/chat/completions", json=sent) as response:
                async for line in response.aiter_lines():
                    if hang_up and line.startswith("data: "):
                        return False  # leaving the block closes the connection mid-stream
                    if line == "data: [DONE]":
                        return True
            return False

        async def run() -> list[bool]:
            limits = httpx.Limits(max_connections=40)
            async with httpx.AsyncClient(timeout=30, limits=limits) as client:
                return await asyncio.gather(*(one(client, hang_up=i % 2 == 0) for i in range(40)))

        finished = asyncio.run(run())
        assert finished.count(True) == 20
        wait_until(lambda: live.active_requests() == 0)

        def outcomes() -> tuple[float, float]:
            ok = _metric(live, 'weir_frontend_requests_total{endpoint="chat",status="200"}')
            return ok, _metric(live, "weir_frontend_client_disconnects_total")

        # A hang-up that lands after the last byte was sent counts as a success, not a disconnect.
        wait_until(lambda: sum(outcomes()) == 40)
        ok, hung_up = outcomes()
        assert ok >= 20 and hung_up > 0
        assert _metric(live, 'weir_frontend_inflight_requests{endpoint="chat"}') == 0
        assert _metric(live, "weir_frontend_errors_total") == 0
        assert httpx.get(f"{live.url}/health").status_code == 200


def test_workers_registered_before_it_starts_are_listed_by_its_first_request(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A model's first worker loads its tokenizer (from the worker's files, when the frontend
    # has no copy): seconds for a large one. The frontend listens once the workers registered
    # before it started are routable, so what `weir serve` prints as ready lists the model.
    load = ModelRegistry._new_model

    async def slow_load(self: ModelRegistry, card: ModelCard, client: Any) -> Any:
        await asyncio.sleep(0.5)  # the load's own time, not a wait for anything
        return await load(self, card, client)

    monkeypatch.setattr(ModelRegistry, "_new_model", slow_load)

    async def first_listing() -> list[str]:
        config = FrontendConfig(port=free_port())
        discovery = MemoryDiscovery(config.namespace)
        host = WorkerHost(mocker_factory(model_dir)(), discovery, None, config.namespace, instance_id="w0")
        await host.start()
        server = uvicorn.Server(uvicorn_config(create_app(config, discovery, None, {"w0": host}), config))
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                assert not serving.done(), "the frontend did not start"
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.port}") as client:
                listing = (await client.get("/v1/models")).json()
            return [model["id"] for model in listing["data"]]
        finally:
            server.should_exit = True
            await serving
            await host.stop()
            await discovery.close()

    assert asyncio.run(first_listing()) == [MODEL]
