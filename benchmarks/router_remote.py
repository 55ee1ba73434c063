"""What asking a standalone router costs a frontend, against deciding in process.

A `RouterService` (kv mode) serves `--workers` workers registered in in-memory discovery,
with no worker processes: each worker's first KV event batch (so no snapshot is needed)
stores some of 200 prefixes of 125 blocks (8,000 tokens in blocks of 64), and a
`RemoteRouter` asks the service over the TCP request plane on loopback. Each request reuses
a random part of a prefix and ends in fresh blocks. Both ends run on one event loop in
this process, so a remote decision's time is the client's and the server's CPU work plus the
loopback round trip: encode, send, decode, `Router.select`, answer, and on finish the Cancel
frame that releases the load. Local figures are `Router.select` + `on_finish` on a router
holding the same index. Wall clock; this machine's cores are shared, so p99s move.

Final JSON line:
  local_p50_us, local_p99_us      select + on_finish in process
  remote_p50_us, remote_p99_us    RemoteRouter.select + on_finish, one request at a time
  remote_concurrent_decisions_per_s   --concurrency requests at a time, decisions per second
  workers, decisions, concurrency

    python benchmarks/router_remote.py [--workers 8] [--decisions 5000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from collections.abc import Sequence

import msgspec

from orchestrator.runtime.discovery import MemoryDiscovery
from orchestrator.runtime.events import MemoryEventPlane
from orchestrator.runtime.protocol import BlockStored, Instance, KvEventBatch, ModelCard, subject
from orchestrator.runtime.request_plane import RequestPlaneClient
from router.protocols import RouteRequest
from router.remote import RemoteRouter
from router.router import Router, make_router
from router.service import RouterService

MODEL = "bench"
BLOCKS = 125  # 8,000 tokens in blocks of 64
PREFIXES = 200


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def workload(workers: list[str], n: int, seed: int = 0) -> tuple[list[KvEventBatch], list[RouteRequest]]:
    """Each worker's first KV batch (the prefixes it holds) and `n` requests on the prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(64) for _ in range(BLOCKS)] for _ in range(PREFIXES)]
    held: dict[str, list[int]] = {worker: [] for worker in workers}
    for prefix in prefixes:
        held[rng.choice(workers)] += prefix
    batches = [
        KvEventBatch(worker_id=w, event_id=1, events=[BlockStored(blocks=blocks)])
        for w, blocks in held.items()
    ]
    reqs = []
    for i in range(n):
        keep = rng.randrange(BLOCKS // 2, BLOCKS)
        hashes = rng.choice(prefixes)[:keep] + [rng.getrandbits(64) for _ in range(BLOCKS - keep)]
        reqs.append(RouteRequest(f"r{i}", BLOCKS * 64, hashes))
    return batches, reqs


def local_router(workers: list[str], batches: Sequence[KvEventBatch] = ()) -> Router:
    router = make_router("kv", 64, model=MODEL)
    for worker in workers:
        router.add_worker(worker, 16_384)
    for batch in batches:
        router.apply_kv_batch(batch)
    return router


async def main(args: argparse.Namespace) -> dict[str, float]:
    workers = [f"w{i}" for i in range(args.workers)]
    batches, reqs = workload(workers, args.decisions)
    discovery, events = MemoryDiscovery("bench"), MemoryEventPlane()
    card = ModelCard(name=MODEL, block_size=64, total_kv_blocks=16_384, backend="mocker")
    for worker in workers:
        # Nobody listens there: the router's snapshot requests fail at once until batch 1 lands.
        instance = Instance(instance_id=worker, component="worker", address="127.0.0.1:1", card=card)
        await discovery.register(instance)
    service = RouterService(discovery, events, "bench", "kv")
    await service.start()
    while MODEL not in service.models or len(service.models[MODEL].workers) < len(workers):
        await asyncio.sleep(0.01)
    for batch in batches:
        await events.publish(subject("bench", MODEL, "kv"), msgspec.msgpack.encode(batch))
    while service.models[MODEL].router.needs_resync():
        await asyncio.sleep(0.01)
    plane = RequestPlaneClient()
    remote = RemoteRouter(plane, service.address, MODEL, local_router(workers))

    local = local_router(workers, batches)
    local_us = []
    for req in reqs:
        started = time.perf_counter_ns()
        decision = local.select(req)
        local.on_finish(decision.worker_id, req.request_id)
        local_us.append((time.perf_counter_ns() - started) / 1e3)

    for req in reqs[:200]:  # warm-up: connection, code paths
        remote.on_finish((await remote.select(req)).worker_id, req.request_id)
    remote_us = []
    for req in reqs:
        started = time.perf_counter_ns()
        decision = await remote.select(req)
        remote.on_finish(decision.worker_id, req.request_id)
        remote_us.append((time.perf_counter_ns() - started) / 1e3)

    queue = list(reversed(reqs))

    async def client() -> None:
        while queue:
            req = queue.pop()
            decision = await remote.select(req)
            await asyncio.sleep(0)  # the request "runs" for a loop iteration
            remote.on_finish(decision.worker_id, req.request_id)

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    concurrent_rate = len(reqs) / (time.perf_counter() - began)
    assert sum(w.inflight_requests for w in remote.fallback.workers.values()) == 0, "some went local"
    remote.close()
    await plane.close()
    await service.stop()
    return {
        "local_p50_us": round(percentile(local_us, 0.5), 1),
        "local_p99_us": round(percentile(local_us, 0.99), 1),
        "remote_p50_us": round(percentile(remote_us, 0.5), 1),
        "remote_p99_us": round(percentile(remote_us, 0.99), 1),
        "remote_concurrent_decisions_per_s": round(concurrent_rate),
        "workers": args.workers,
        "decisions": args.decisions,
        "concurrency": args.concurrency,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--decisions", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    import uvloop

    logging.getLogger("router.subscriber").setLevel(logging.ERROR)  # the failing snapshot requests

    figures = uvloop.run(main(parser.parse_args()))
    print(f"local decision      p50 {figures['local_p50_us']:.0f} us, p99 {figures['local_p99_us']:.0f} us")
    print(f"remote decision     p50 {figures['remote_p50_us']:.0f} us, p99 {figures['remote_p99_us']:.0f} us")
    rate = figures["remote_concurrent_decisions_per_s"]
    print(f"remote, {figures['concurrency']} at a time: {rate:.0f} decisions/s")
    print(json.dumps(figures))
