"""The per-worker circuit breaker of `ModelRoutes`: a tripped worker is left out of every
decision for its back-off, probed by one request after it, restored by a success or a new
discovery record; when every worker is tripped, requests still get a worker."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.runtime.protocol import Instance, ModelCard
from orchestrator.runtime.request_plane import RequestPlaneClient, TcpWorkerClient
from router.protocols import NoWorkerAvailable, RouteRequest
from router.router import make_router
from router.table import BREAKER_BACKOFF_S, BREAKER_MAX_BACKOFF_S, ModelRoutes

WORKERS = ("w0", "w1", "w2")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def routes(mode: str = "round-robin") -> tuple[ModelRoutes, Clock]:
    clock = Clock()
    r = ModelRoutes("m", make_router(mode, 16, model="m"), clock=clock)
    plane = RequestPlaneClient()  # never dialled: only decisions are made here
    for w in WORKERS:
        card = ModelCard(name="m", block_size=16, total_kv_blocks=100)
        r.add_worker(
            Instance(instance_id=w, component="worker", card=card), 100, TcpWorkerClient(plane, "x:1")
        )
    return r, clock


def chosen(r: ModelRoutes, n: int, exclude: tuple[str, ...] = ()) -> set[str]:
    async def pick() -> set[str]:
        out = set()
        for i in range(n):
            decision = await r.select(RouteRequest(f"r{i}", 40, [1, 2]), exclude)
            r.on_finish(decision.worker_id, f"r{i}")
            out.add(decision.worker_id)
        return out

    return asyncio.run(pick())


@pytest.mark.parametrize("mode", ["round-robin", "kv", "ttft", "least-loaded"])
def test_a_tripped_worker_gets_nothing_until_its_backoff_ends(mode: str) -> None:
    r, clock = routes(mode)
    assert r.trip("w1")
    assert not r.trip("w1")  # the other requests on the same lost connection: one trip
    assert chosen(r, 12) <= {"w0", "w2"}
    clock.now += BREAKER_BACKOFF_S
    # Half-open: a request placed on it is the probe (here one that failed on the others), and
    # until the probe ends nobody else goes there.
    assert chosen(r, 1, exclude=("w0", "w2")) == {"w1"}
    assert r.trips["w1"].probing
    assert chosen(r, 12) <= {"w0", "w2"}
    r.restore("w1")  # the probe streamed a token
    assert "w1" not in r.trips
    if mode == "round-robin":
        assert "w1" in chosen(r, 3)


def test_backoff_doubles_on_each_failed_probe_up_to_its_cap() -> None:
    r, clock = routes()
    r.trip("w1")
    backoffs = []
    for _ in range(6):
        backoffs.append(r.trips["w1"].backoff_s)
        clock.now += r.trips["w1"].backoff_s
        assert chosen(r, 1, exclude=("w0", "w2")) == {"w1"}  # the probe went there...
        assert r.trip("w1")  # ...and failed
    assert backoffs == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoffs[-1] == BREAKER_MAX_BACKOFF_S


def test_a_new_discovery_record_restores_it() -> None:
    r, _ = routes()
    r.trip("w1")
    card = ModelCard(name="m", block_size=16, total_kv_blocks=100)
    r.remove_worker("w1")
    r.add_worker(
        Instance(instance_id="w1", component="worker", card=card),
        100,
        TcpWorkerClient(RequestPlaneClient(), "x:2"),
    )
    assert "w1" in chosen(r, 12)


def test_with_every_worker_tripped_the_least_recently_tripped_serves() -> None:
    r, clock = routes()
    for w in ("w2", "w0", "w1"):
        r.trip(w)
        clock.now += 0.1
    assert chosen(r, 1) == {"w2"}
    # The one it is probing is left alone meanwhile; the next oldest takes the next request.
    assert chosen(r, 1) == {"w0"}
    # A request that already failed on w0 and w1 still gets w2 rather than no worker.
    assert chosen(r, 1, exclude=("w0", "w1")) == {"w2"}
    with pytest.raises(NoWorkerAvailable):
        chosen(r, 1, exclude=WORKERS)
