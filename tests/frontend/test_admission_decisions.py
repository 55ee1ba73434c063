"""Admission control and the circuit breaker: a worker whose breaker is open is no room (a
request admitted onto it would only fail over), a worker due for its probe is, and with every
routable worker tripped the request is admitted for the router's probe rather than held."""

from __future__ import annotations

import asyncio

from orchestrator.frontend.admission import Admission
from orchestrator.frontend.config import FrontendConfig
from orchestrator.frontend.metrics import Metrics
from orchestrator.runtime.protocol import Instance, ModelCard
from orchestrator.runtime.request_plane import RequestPlaneClient, TcpWorkerClient
from router.protocols import RouteRequest
from router.router import make_router
from router.table import BREAKER_BACKOFF_S, ModelRoutes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(workers: tuple[str, ...] = ("w0", "w1")) -> tuple[ModelRoutes, Admission, Clock]:
    clock = Clock()
    routes = ModelRoutes("m", make_router("round-robin", 16, model="m"), clock=clock)
    plane = RequestPlaneClient()  # never dialled: only decisions are made here
    for w in workers:
        card = ModelCard(name="m", block_size=16, total_kv_blocks=100)
        routes.add_worker(
            Instance(instance_id=w, component="worker", card=card), 100, TcpWorkerClient(plane, "x:1")
        )
    # Any block in use makes a worker busy.
    config = FrontendConfig(active_decode_blocks_threshold=0.01, max_queued_requests=4, max_queue_wait_s=5.0)
    return routes, Admission(config, routes, Metrics().for_model("m")), clock


def occupy(routes: ModelRoutes, worker: str, request_id: str = "busy") -> None:
    """Route a two-block request onto `worker` (the router counts its blocks at once)."""
    others = [w for w in routes.router.workers if w != worker]
    decision = routes.router.select(RouteRequest(request_id, 32, [1, 2]), others)
    assert decision.worker_id == worker
    assert routes.router.workers[worker].kv_usage >= 0.01


def test_a_tripped_worker_is_no_room_until_its_probe_is_due() -> None:
    routes, admission, clock = setup()
    occupy(routes, "w0")
    assert admission.has_room()  # w1 is idle
    assert routes.trip("w1")
    assert not admission.has_room()  # w1's breaker is open, w0 is busy: wait for a healthy worker
    clock.now += BREAKER_BACKOFF_S
    assert admission.has_room()  # w1 is due for its probe: it may take one
    routes.restore("w1")
    assert admission.has_room()


def test_every_routable_worker_tripped_admits_at_once() -> None:
    routes, admission, _ = setup()
    occupy(routes, "w0")
    routes.trip("w0")
    routes.trip("w1")
    # The router would place it on the soonest-due tripped worker: admission does not hold it.
    assert admission.has_room()
    routes.router.set_draining("w0", True)
    assert admission.has_room()
    routes.router.set_draining("w0", False)
    routes.restore("w0")
    assert not admission.has_room()  # w0 is healthy again, and busy: wait for it


def test_a_request_waits_for_the_healthy_worker_not_the_tripped_one() -> None:
    async def scenario() -> None:
        routes, admission, _ = setup()
        occupy(routes, "w0")
        routes.trip("w1")
        waiting = asyncio.create_task(admission.admit())
        for _ in range(100):  # yield until it is in the queue
            if admission.metrics.queued._value.get() == 1:
                break
            await asyncio.sleep(0)
        assert not waiting.done()
        assert admission.metrics.queued._value.get() == 1
        routes.on_finish("w0", "busy")  # w0's request ended...
        admission.release()  # ...which admits the next
        await asyncio.wait_for(waiting, 2.0)
        assert admission.metrics.queued._value.get() == 0

    asyncio.run(scenario())
