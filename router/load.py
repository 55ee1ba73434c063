"""Per-worker load: workers' load reports plus the requests routers have in flight.

Reports arrive about once a second, so between them the router counts what it sent itself:
each in-flight request's prompt blocks, with blocks shared by several requests on one
worker counted once (they share KV on the worker too). Replica routers publish their own
sends and finishes (`InflightUpdate`), counted here by block totals; an update from a
replica that died without finishing its requests expires after `peer_ttl_s`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.runtime.protocol import LoadReport
from router.protocols import InflightUpdate, RouteRequest, WorkerLoad
from router.step_time import StepTime


@dataclass(slots=True)
class _Request:
    worker_id: str
    hashes: list[int]
    tail_blocks: int  # prompt blocks without a hash (the partial last one)


@dataclass(slots=True)
class _PeerRequest:
    worker_id: str
    blocks: int
    seen_at: float


class LoadTracker:
    def __init__(
        self,
        router_id: str,
        block_size: int,
        peer_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router_id = router_id
        self.block_size = block_size
        self.peer_ttl_s = peer_ttl_s
        self._clock = clock
        self.workers: dict[str, WorkerLoad] = {}
        # Workers marked draining, kept apart so a decision checks one set, not every worker.
        self.draining: set[str] = set()
        self._requests: dict[str, _Request] = {}
        # worker -> seq hash -> in-flight requests (the KV index reads it too). A Counter for
        # its C-level `update`; entries are deleted with dict.pop, as Counter's own
        # __delitem__ is Python code.
        self.held: dict[str, Counter[int]] = {}
        self._peers: dict[tuple[str, str], _PeerRequest] = {}

    def add_worker(self, worker_id: str, total_blocks: int = 0) -> WorkerLoad:
        load = self.workers.setdefault(worker_id, WorkerLoad(total_blocks=total_blocks))
        load.refresh()
        self.held.setdefault(worker_id, Counter())
        return load

    def remove_worker(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self.draining.discard(worker_id)
        self.held.pop(worker_id, None)
        for request_id in [r for r, req in self._requests.items() if req.worker_id == worker_id]:
            del self._requests[request_id]
        for key in [k for k, peer in self._peers.items() if peer.worker_id == worker_id]:
            del self._peers[key]

    def apply_report(self, report: LoadReport) -> None:
        load = self.workers.get(report.worker_id)
        if load is None:
            return  # discovery, not load reports, decides which workers exist
        load.active_requests = report.active_requests
        load.waiting_requests = report.waiting_requests
        load.active_blocks = report.active_blocks
        load.queued_prefill_tokens = report.queued_prefill_tokens
        load.routed_prefill_tokens = 0
        load.total_blocks = report.total_blocks or load.total_blocks
        if report.step_time is not None:
            load.step_time = StepTime.from_curves(report.step_time)
        load.refresh()
        if report.draining:
            self.set_draining(report.worker_id, True)

    def set_draining(self, worker_id: str, draining: bool) -> None:
        load = self.workers.get(worker_id)
        if load is None:
            return
        load.draining = draining
        if draining:
            self.draining.add(worker_id)
        else:
            self.draining.discard(worker_id)

    # ------------------------------------------------------------------ own requests

    def on_routed(self, worker_id: str, request: RouteRequest, cached_blocks: int = 0) -> InflightUpdate:
        if request.request_id in self._requests:  # a retried id: release the first placement
            self.on_finish(self._requests[request.request_id].worker_id, request.request_id)
        hashes = request.block_hashes
        total = -(-request.num_tokens // self.block_size)
        tail = max(total - len(hashes), 0)
        self._requests[request.request_id] = _Request(worker_id, hashes, tail)
        held = self.held[worker_id]
        load = self.workers[worker_id]
        before = len(held)
        held.update(hashes)
        new = len(held) - before  # blocks no other in-flight request on this worker holds
        load.inflight_requests += 1
        load.inflight_blocks += new + tail
        load.routed_prefill_tokens += max(request.num_tokens - cached_blocks * self.block_size, 0)
        load.refresh()
        return InflightUpdate(
            router_id=self.router_id, worker_id=worker_id, request_id=request.request_id, blocks=new + tail
        )

    def on_finish(self, worker_id: str, request_id: str | None = None) -> InflightUpdate | None:
        if request_id is None:
            # Callers that do not name the request: release the oldest one on that worker.
            request_id = next((r for r, req in self._requests.items() if req.worker_id == worker_id), None)
        request = self._requests.get(request_id) if request_id is not None else None
        load = self.workers.get(worker_id)
        if request is None or request_id is None or load is None or request.worker_id != worker_id:
            # Unknown, or the end of an earlier placement of a reused id, released when the
            # id was routed again: the blocks counted now belong to the later placement.
            return None
        del self._requests[request_id]
        held = self.held[worker_id]
        freed = request.tail_blocks
        for seq_hash in request.hashes:
            n = held[seq_hash] - 1
            if n:
                held[seq_hash] = n
            else:
                held.pop(seq_hash)
                freed += 1
        load.inflight_requests -= 1
        load.inflight_blocks -= freed
        load.refresh()
        return InflightUpdate(
            router_id=self.router_id, worker_id=worker_id, request_id=request_id, blocks=freed, done=True
        )

    # ------------------------------------------------------------------ replicas

    def inflight_updates(self) -> list[InflightUpdate]:
        """What a replica that has just appeared needs of this router's load: an update for
        each request in flight, its blocks those no earlier request in flight on the same
        worker holds (as `on_routed` counts them), so the totals match ours."""
        counted: dict[str, set[int]] = {}
        updates = []
        for request_id, request in self._requests.items():
            worker_id = request.worker_id
            seen = counted.setdefault(worker_id, set())
            before = len(seen)
            seen.update(request.hashes)
            blocks = len(seen) - before + request.tail_blocks
            updates.append(
                InflightUpdate(
                    router_id=self.router_id, worker_id=worker_id, request_id=request_id, blocks=blocks
                )
            )
        return updates

    def forget_peer(self, router_id: str) -> None:
        """A replica fell silent: what it had in flight no longer counts."""
        for key in [key for key in self._peers if key[0] == router_id]:
            self._drop_peer(self._peers.pop(key))

    def apply_peer(self, update: InflightUpdate) -> None:
        if update.router_id == self.router_id:
            return  # our own message, echoed by the event plane
        self._expire_peers()
        key = (update.router_id, update.request_id)
        load = self.workers.get(update.worker_id)
        if update.done:
            peer = self._peers.pop(key, None)
            if peer is not None:
                self._drop_peer(peer)
        elif load is not None and key not in self._peers:
            self._peers[key] = _PeerRequest(update.worker_id, update.blocks, self._clock())
            load.inflight_requests += 1
            load.inflight_blocks += update.blocks
            load.refresh()

    def _expire_peers(self) -> None:
        cutoff = self._clock() - self.peer_ttl_s
        # Insertion order is arrival order, so the stale ones are at the front.
        while self._peers:
            key, peer = next(iter(self._peers.items()))
            if peer.seen_at > cutoff:
                return
            del self._peers[key]
            self._drop_peer(peer)

    def _drop_peer(self, peer: _PeerRequest) -> None:
        load = self.workers.get(peer.worker_id)
        if load is not None:
            load.inflight_requests -= 1
            load.inflight_blocks -= peer.blocks
            load.refresh()
