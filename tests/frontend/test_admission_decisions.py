"""Admission control's decisions, without a server. The prefill threshold counts what was
routed since the last load report. And the circuit breaker: a worker whose breaker is open is
no room (a request admitted onto it would only fail over), a worker due for its probe is (the
queue wakes itself then), and with every routable worker tripped the request is admitted for
the router's probe rather than held."""

from __future__ import annotations

import asyncio
import time

from orchestrator.frontend.admission import Admission
from orchestrator.frontend.config import FrontendConfig
from orchestrator.frontend.metrics import Metrics
from orchestrator.runtime.protocol import Instance, LoadReport, ModelCard
from orchestrator.runtime.request_plane import RequestPlaneClient, TcpWorkerClient
from router.protocols import RouteRequest
from router.router import make_router
from router.table import BREAKER_BACKOFF_S, ModelRoutes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(
    workers: tuple[str, ...] = ("w0", "w1"), clock: Clock | None = None, **thresholds: float
) -> tuple[ModelRoutes, Admission]:
    routes = ModelRoutes("m", make_router("round-robin", 16, model="m"), clock=clock or time.monotonic)
    plane = RequestPlaneClient()  # never dialled: only decisions are made here
    for w in workers:
        card = ModelCard(name="m", block_size=16, total_kv_blocks=100)
        routes.add_worker(
            Instance(instance_id=w, component="worker", card=card), 100, TcpWorkerClient(plane, "x:1")
        )
    # By default any block in use makes a worker busy.
    thresholds = thresholds or {"active_decode_blocks_threshold": 0.01}
    config = FrontendConfig(max_queued_requests=4, max_queue_wait_s=5.0, **thresholds)  # type: ignore[arg-type]
    return routes, Admission(config, routes, Metrics().for_model("m"))


def occupy(routes: ModelRoutes, worker: str, request_id: str = "busy") -> None:
    """Route a two-block request onto `worker` (the router counts its blocks at once)."""
    others = [w for w in routes.router.workers if w != worker]
    decision = routes.router.select(RouteRequest(request_id, 32, [1, 2]), others)
    assert decision.worker_id == worker
    assert routes.router.workers[worker].kv_usage >= 0.01


def test_a_tripped_worker_is_no_room_until_its_probe_is_due() -> None:
    clock = Clock()
    routes, admission = setup(clock=clock)
    occupy(routes, "w0")
    assert admission.has_room()  # w1 is idle
    assert routes.trip("w1")
    assert not admission.has_room()  # w1's breaker is open, w0 is busy: wait for a healthy worker
    clock.now += BREAKER_BACKOFF_S
    assert admission.has_room()  # w1 is due for its probe: it may take one
    routes.restore("w1")
    assert admission.has_room()


def test_every_routable_worker_tripped_admits_at_once() -> None:
    routes, admission = setup(clock=Clock())
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
        routes, admission = setup(clock=Clock())
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


async def _queued(admission: Admission) -> asyncio.Task[None]:
    waiting = asyncio.create_task(admission.admit())
    for _ in range(100):  # yield until it is in the queue
        if admission.metrics.queued._value.get() == 1:
            break
        await asyncio.sleep(0)
    assert not waiting.done() and admission.metrics.queued._value.get() == 1
    return waiting


def test_the_queue_wakes_when_a_breaker_back_off_ends() -> None:
    # No request finishes and no load report arrives (a tripped worker sends none): the
    # waiting request is admitted by the back-off's end alone, for the router's probe.
    async def scenario() -> None:
        routes, admission = setup()
        occupy(routes, "w0")
        routes.trip("w1")
        tripped_at = time.monotonic()
        waiting = await _queued(admission)
        await asyncio.wait_for(waiting, BREAKER_BACKOFF_S + 2.0)
        assert time.monotonic() - tripped_at >= BREAKER_BACKOFF_S * 0.9
        assert admission.metrics.queued._value.get() == 0

    asyncio.run(scenario())


def test_prefill_threshold_counts_tokens_routed_since_the_last_report() -> None:
    routes, admission = setup(("w0",), active_prefill_tokens_threshold=100)
    load = routes.router.workers["w0"]
    assert admission.has_room()
    routes.router.select(RouteRequest("a", 96, [1, 2, 3, 4, 5, 6]))
    assert load.prefill_tokens == 96 and admission.has_room()  # below 100, though no report came yet
    routes.router.select(RouteRequest("b", 16, [7]))
    assert load.prefill_tokens == 112 and not admission.has_room()
    # The worker's report now covers them: it has prefilled all but 40.
    routes.router.apply_load(LoadReport(worker_id="w0", queued_prefill_tokens=40))
    assert load.prefill_tokens == 40 and admission.has_room()
