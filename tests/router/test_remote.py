"""`RouterService` and `RemoteRouter` in one process over the real TCP request plane: mocker
workers behind `WorkerHost`s, in-memory discovery and event plane. The route follows the
cache, `finish` releases the router's in-flight load, bad calls get typed errors, and an
unreachable router leaves placement to the local fallback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from backends.mocker.config import MockerConfig
from backends.mocker.engine import MockerEngine
from orchestrator.runtime.discovery import MemoryDiscovery
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.events import MemoryEventPlane
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest
from orchestrator.runtime.request_plane import RequestPlaneClient, TcpWorkerClient
from orchestrator.runtime.worker_host import WorkerHost
from router.endpoints import ROUTE, RouteCall
from router.indexer import KvIndexer
from router.protocols import RouteRequest
from router.remote import RemoteRouter
from router.router import make_router
from router.service import RouterService
from tests.servers import free_port
from tests.waiting import eventually

MODEL = "m"
BS = 16
PREFIX = list(range(10, 10 + 8 * BS))


@dataclass
class Setup:
    service: RouterService
    hosts: dict[str, WorkerHost]
    plane: RequestPlaneClient

    def remote(self, address: str | None = None, **kwargs: Any) -> RemoteRouter:
        fallback = make_router("least-loaded", BS, model=MODEL)
        for worker_id in self.hosts:
            fallback.add_worker(worker_id)
        return RemoteRouter(self.plane, address or self.service.address, MODEL, fallback, **kwargs)

    async def run(self, worker_id: str, tokens: list[int]) -> None:
        request = WorkerRequest(
            request_id=f"run-{len(tokens)}-{tokens[-1]}",
            token_ids=tokens,
            max_tokens=1,
            sampling=SamplingOptions(),
            block_hashes=block_hashes(tokens, BS),
            ignore_eos=True,
        )
        async for _ in TcpWorkerClient(self.plane, self.hosts[worker_id].address).generate(request):
            pass


def route(request_id: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(request_id, len(tokens), block_hashes(tokens, BS))


@pytest_asyncio.fixture
async def setup() -> AsyncIterator[Setup]:
    discovery, events = MemoryDiscovery("rs"), MemoryEventPlane()
    config = MockerConfig(model_name=MODEL, block_size=BS, num_blocks=256, speedup=1000, vocab_size=400)
    hosts = {w: WorkerHost(MockerEngine(config), discovery, events, "rs", instance_id=w) for w in ("a", "b")}
    service = RouterService(discovery, events, "rs", "kv")
    plane = RequestPlaneClient()
    for host in hosts.values():
        await host.start()
    await service.start()
    try:
        await eventually(lambda: MODEL in service.models and len(service.models[MODEL].workers) == 2)
        await eventually(lambda: not service.models[MODEL].router.needs_resync())
        yield Setup(service, hosts, plane)
    finally:
        await plane.close()
        await service.stop()
        for host in hosts.values():
            await host.stop()


async def test_registers_and_routes_to_the_worker_holding_the_prefix(setup: Setup) -> None:
    (instance,) = await setup.service.discovery.list("router")
    assert instance.address == setup.service.address
    remote = setup.remote()
    first = await remote.select(route("r1", [*PREFIX, 1]))
    assert first.overlap_blocks == 0
    remote.on_finish(first.worker_id, "r1")
    await setup.run(first.worker_id, [*PREFIX, 1])
    router = setup.service.models[MODEL].router
    assert isinstance(router.index, KvIndexer)
    held = router.index.blocks.blocks_of
    owner = router.workers[first.worker_id]
    # The prefix is indexed, and the owner is idle again (finish delivered, load reported):
    # otherwise its in-flight blocks could outweigh its hits in the cost.
    await eventually(lambda: len(held(first.worker_id).get("device", ())) >= len(PREFIX) // BS)
    await eventually(lambda: owner.blocks == 0)
    for i in range(2, 5):
        decision = await remote.select(route(f"r{i}", [*PREFIX, i]))
        assert (decision.worker_id, decision.overlap_blocks) == (first.worker_id, len(PREFIX) // BS)
        remote.on_finish(decision.worker_id, f"r{i}")
        await eventually(lambda: owner.inflight_requests == 0)


async def test_finish_releases_the_routers_inflight_load(setup: Setup) -> None:
    remote = setup.remote()
    loads = setup.service.models[MODEL].router.workers
    decision = await remote.select(route("held", PREFIX))
    assert loads[decision.worker_id].inflight_requests == 1
    remote.on_finish(decision.worker_id, "held")
    await eventually(lambda: loads[decision.worker_id].inflight_requests == 0)


async def test_a_caller_that_goes_away_releases_its_requests(setup: Setup) -> None:
    """A frontend that dies mid-request leaves no load behind on the router."""
    own_plane = RequestPlaneClient()
    remote = RemoteRouter(own_plane, setup.service.address, MODEL, setup.remote().fallback)
    for i in range(3):
        await remote.select(route(f"gone{i}", [*PREFIX, i]))
    loads = setup.service.models[MODEL].router.workers
    assert sum(w.inflight_requests for w in loads.values()) == 3
    await own_plane.close()  # the connection drops, as when the process dies
    await eventually(lambda: sum(w.inflight_requests for w in loads.values()) == 0)


async def test_excluded_workers_are_not_chosen(setup: Setup) -> None:
    remote = setup.remote()
    for i in range(4):
        decision = await remote.select(route(f"x{i}", PREFIX), exclude=["a"])
        assert decision.worker_id == "b"
        remote.on_finish("b", f"x{i}")


async def call_route(setup: Setup, payload: bytes) -> EngineError:
    stream = setup.plane.stream(setup.service.address, ROUTE, payload)
    with pytest.raises(EngineError) as caught:
        await anext(stream)
    return caught.value


async def test_bad_calls_get_typed_errors(setup: Setup) -> None:
    unknown = RouteCall(model="nope", request_id="u", num_tokens=1)
    assert (await call_route(setup, msgspec.msgpack.encode(unknown))).code == "invalid_request"
    assert (await call_route(setup, b"\x01garbage")).code == "invalid_request"
    none_left = RouteCall(model=MODEL, request_id="n", num_tokens=1, exclude=["a", "b"])
    error = await call_route(setup, msgspec.msgpack.encode(none_left))
    assert (error.code, error.retryable) == ("unavailable", False)
    # the router still serves after refusing
    decision = await setup.remote().select(route("ok", PREFIX))
    assert decision.worker_id in setup.hosts


async def test_load_no_real_prompt_could_have_is_refused(setup: Setup) -> None:
    loads = setup.service.models[MODEL].router.workers
    for bad in (
        RouteCall(model=MODEL, request_id="huge", num_tokens=10**9),
        RouteCall(model=MODEL, request_id="neg", num_tokens=-1),
        # more full blocks than the tokens make
        RouteCall(model=MODEL, request_id="blocks", num_tokens=BS, block_hashes=block_hashes(PREFIX, BS)),
    ):
        assert (await call_route(setup, msgspec.msgpack.encode(bad))).code == "invalid_request"
    assert all(w.inflight_requests == 0 and w.blocks == 0 for w in loads.values())
    decision = await setup.remote().select(route("fine", PREFIX))  # a real prompt's load routes
    assert decision.worker_id in setup.hosts


async def test_unreachable_router_falls_back_locally_then_is_retried(setup: Setup) -> None:
    now = [0.0]
    dead = f"127.0.0.1:{free_port()}"
    remote = setup.remote(dead, retry_s=5.0, clock=lambda: now[0])
    decision = await remote.select(route("f1", PREFIX))
    assert (
        decision.worker_id in setup.hosts
        and remote.fallback.workers[decision.worker_id].inflight_requests == 1
    )
    remote.on_finish(decision.worker_id, "f1")
    assert remote.fallback.workers[decision.worker_id].inflight_requests == 0
    service_loads = setup.service.models[MODEL].router.workers
    remote.address = setup.service.address  # the router is back (e.g. restarted elsewhere)
    await remote.select(route("f2", PREFIX))  # still within the backoff: placed locally
    assert sum(w.inflight_requests for w in service_loads.values()) == 0
    now[0] = 5.0
    await remote.select(route("f3", PREFIX))
    assert sum(w.inflight_requests for w in service_loads.values()) == 1
