"""Offline trace replay: the real router against mocker engines, in virtual time.

A discrete-event simulation. Requests arrive at their trace timestamps and are routed by
the router exactly as the frontend would route them; each worker is a `MockerCore` that
steps whenever it has work, its clock advancing by the step's simulated duration. What a
step produced (tokens, KV events, a load report) becomes visible when the step ends; KV
events reach the router `kv_event_delay_ms` later, as they would over the event plane.
Nothing sleeps, so an hour of traffic replays in seconds.

It lives with the mocker rather than in `router/` because it runs engines: the router
package stays below the backends and imports none of them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count

from msgspec.structs import replace

from backends.mocker.config import MockerConfig
from backends.mocker.core import MockerCore, StepResult
from kvbm.stores import HostStore
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import KvEventBatch, WorkerRequest
from router.protocols import RouteRequest
from router.replay import RequestRecord, TraceRequest, TraceTokens
from router.router import Router

_ARRIVAL, _STEP_DONE, _KV_EVENTS = 0, 1, 2


class VirtualClock:
    """The simulation's time in seconds, for the router's TTLs (`make_router(clock=...)`)."""

    def __init__(self) -> None:
        self.now_ms = 0.0

    def __call__(self) -> float:
        return self.now_ms / 1e3


@dataclass(slots=True)
class _Worker:
    worker_id: str
    core: MockerCore
    busy: bool = False


class OfflineReplay:
    def __init__(
        self,
        router: Router,
        config: MockerConfig,
        num_workers: int,
        tokens: TraceTokens,
        kv_event_delay_ms: float = 0.0,
        clock: VirtualClock | None = None,
        shared_cache_blocks: int = 0,
    ) -> None:
        if num_workers <= 0:
            raise ValueError("num_workers must be positive")
        self.router = router
        self.config = config
        self.tokens = tokens
        self.kv_event_delay_ms = kv_event_delay_ms
        self.clock = clock or VirtualClock()
        # One G4 for all workers, as one Redis serves a model's workers.
        shared = HostStore(shared_cache_blocks, 0, tier="remote") if shared_cache_blocks else None
        self.workers = [_Worker(f"mocker-{i}", MockerCore(config, shared)) for i in range(num_workers)]
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = count()
        self._by_id = {w.worker_id: w for w in self.workers}
        self._records: dict[str, RequestRecord] = {}
        self._on_finish: Callable[[RequestRecord], None] | None = None

    def run(
        self, trace: Sequence[TraceRequest], on_finish: Callable[[RequestRecord], None] | None = None
    ) -> list[RequestRecord]:
        """Replay `trace`; `on_finish` hears of each request once, when it finishes or fails."""
        self._on_finish = on_finish
        for w in self.workers:
            self.router.add_worker(w.worker_id, total_blocks=self.config.num_blocks)
            self.router.apply_kv_snapshot(replace(w.core.kv_snapshot(), worker_id=w.worker_id))
        start = trace[0].timestamp_ms if trace else 0.0
        for request in trace:
            self._push(request.timestamp_ms - start, _ARRIVAL, request)
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            self.clock.now_ms = now
            if kind == _ARRIVAL:
                assert isinstance(payload, TraceRequest)
                self._arrive(now, payload)
            elif kind == _STEP_DONE:
                assert isinstance(payload, tuple)
                self._step_done(now, *payload)
            else:
                assert isinstance(payload, list)
                for batch in payload:
                    self._deliver(batch)
        return list(self._records.values())

    def _push(self, at: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, payload))

    def _arrive(self, now: float, request: TraceRequest) -> None:
        request_id = f"trace-{request.line}"
        record = RequestRecord(arrival_ms=now, prompt_tokens=request.input_length)
        self._records[request_id] = record
        tokens = self.tokens.prompt(request)
        hashes = block_hashes(tokens, self.config.block_size)
        decision = self.router.select(RouteRequest(request_id, len(tokens), hashes))
        worker = self._by_id[decision.worker_id]
        record.worker_id = worker.worker_id
        work = WorkerRequest(
            request_id=request_id,
            token_ids=tokens,
            max_tokens=request.output_length,
            block_hashes=hashes,
            ignore_eos=True,
        )
        try:
            worker.core.add(work)
        except ValueError as exc:
            record.error = str(exc)
            self.router.on_finish(worker.worker_id, request_id)
            if self._on_finish is not None:
                self._on_finish(record)
            return
        if not worker.busy:
            self._start_step(now, worker)

    def _start_step(self, now: float, worker: _Worker) -> None:
        result = worker.core.step()
        if not result.outputs and result.duration_ms == 0.0:
            worker.busy = False  # nothing schedulable until a request arrives
            return
        worker.busy = True
        self._push(now + result.duration_ms, _STEP_DONE, (worker, result))

    def _step_done(self, now: float, worker: _Worker, result: StepResult) -> None:
        for out in result.outputs:
            record = self._records[out.request_id]
            if out.token_ids and record.first_token_ms is None:
                record.first_token_ms = now
            record.output_tokens += len(out.token_ids)
            if out.finish_reason is not None:
                record.finish_ms = now
                if out.usage is not None:
                    record.cached_tokens = out.usage.cached_tokens
                self.router.on_finish(worker.worker_id, out.request_id)
                if self._on_finish is not None:
                    self._on_finish(record)
        batches = [replace(b, worker_id=worker.worker_id) for b in worker.core.take_kv_events()]
        if batches:
            if self.kv_event_delay_ms > 0:
                self._push(now + self.kv_event_delay_ms, _KV_EVENTS, batches)
            else:
                for batch in batches:
                    self._deliver(batch)
        self.router.apply_load(replace(worker.core.load(), worker_id=worker.worker_id))
        if worker.core.has_work():
            self._start_step(now, worker)
        else:
            worker.busy = False

    def _deliver(self, batch: KvEventBatch) -> None:
        if self.router.apply_kv_batch(batch):
            # A gap cannot happen in-process; if it ever does, resync as a subscriber would.
            worker = self._by_id[batch.worker_id]
            self.router.apply_kv_snapshot(replace(worker.core.kv_snapshot(), worker_id=batch.worker_id))
