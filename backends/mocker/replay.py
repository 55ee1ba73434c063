"""Offline trace replay: the real router against mocker engines, in virtual time.

A discrete-event simulation. Requests arrive at their trace timestamps and are routed by
the router exactly as the frontend would route them; each worker is a `MockerCore` that
steps whenever it has work, its clock advancing by the step's simulated duration. What a
step produced (tokens, KV events, a load report) becomes visible when the step ends; KV
events reach the router `kv_event_delay_ms` later, as they would over the event plane.
Nothing sleeps, so an hour of traffic replays in seconds. Most steps of a lightly loaded
worker are the same decode step over and over; a run of them up to the next change (a block
filling, a request ending, an arrival) is one event (`MockerCore.decode_stretch`), with the
outputs and times that stepping each would give. An arrival elsewhere changes nothing a
stretch depends on, so a stretch runs to its end unless a request arrives for its own worker:
then it ends with the last of its steps that started before the arrival.

Disaggregation (`prefill_router` and `num_prefill_workers`): a second pool of mockers takes
the prefills the policy (`router.disagg`, the frontend's own) sends there, as the frontend's
two-phase dispatch does: the prefill-only request's first token, then the decode on a worker
of the main pool once the KV's bytes crossed at `transfer_bandwidth_gbps` (the prefill's
blocks are held until then). The main pool's workers are then the decode role, and take
whole requests when the policy keeps one aggregated.

It lives with the mocker rather than in `router/` because it runs engines: the router
package stays below the backends and imports none of them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count

from msgspec.structs import replace

from backends.mocker.config import MockerConfig
from backends.mocker.core import MockerCore, RequestOutput, StepResult
from kvbm.records import Payload
from kvbm.stores import HostStore
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import KvEventBatch, KvTransfer, WorkerRequest
from router.disagg import DisaggPolicy
from router.protocols import RouteRequest
from router.replay import RequestRecord, TraceRequest, TraceTokens
from router.router import Router

_ARRIVAL, _STEP_DONE, _KV_EVENTS, _HANDOVER, _STRETCH_DONE = 0, 1, 2, 3, 4


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
    router: Router  # its pool's
    busy: bool = False
    # The decode stretch it is in, if any: (start, step_ms, steps), not yet applied to the core
    # (an arrival for this worker may cut it short); its queued end counts only while this
    # is the very tuple the event carries.
    stretch: tuple[float, float, int] | None = None


@dataclass(slots=True)
class _Handover:
    """A prefilled request on its way to a decode worker."""

    prefill: _Worker
    decode: _Worker
    request: WorkerRequest
    transfer: KvTransfer | None
    records: list[bytes]


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
        prefill_router: Router | None = None,
        num_prefill_workers: int = 0,
        disagg: DisaggPolicy | None = None,
        stretches: bool = True,
    ) -> None:
        """`stretches`: take runs of identical decode steps as one event (`_take_stretch`);
        False steps every one, the reference the stretches are tested against."""
        if num_workers <= 0:
            raise ValueError("num_workers must be positive")
        if (prefill_router is None) != (num_prefill_workers == 0):
            raise ValueError("a prefill pool needs both its router and its workers")
        self.router = router
        self.prefill_router = prefill_router
        self.disagg = disagg or DisaggPolicy()
        self.config = config
        self.tokens = tokens
        self.kv_event_delay_ms = kv_event_delay_ms
        self.clock = clock or VirtualClock()
        # One G4 for all workers, as one Redis serves a model's workers.
        shared = HostStore(shared_cache_blocks, 0, tier="remote") if shared_cache_blocks else None
        name = "decode" if prefill_router is not None else "mocker"
        self.workers = [
            _Worker(f"{name}-{i}", MockerCore(config, shared), router) for i in range(num_workers)
        ]
        self.prefill_workers = [
            _Worker(f"prefill-{i}", MockerCore(config, shared), prefill_router)
            for i in range(num_prefill_workers)
            if prefill_router is not None
        ]
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = count()
        self._by_id = {w.worker_id: w for w in (*self.workers, *self.prefill_workers)}
        self._records: dict[str, RequestRecord] = {}
        self._prefilling: dict[str, WorkerRequest] = {}  # request id -> its decode, once prefilled
        self._handed_over: set[str] = set()  # decodes whose prompt's cache hits were the prefill's
        self.disaggregated = 0  # requests whose prefill ran on the prefill pool
        self._on_finish: Callable[[RequestRecord], None] | None = None
        # A prefill pool's handovers arrive at times no trace tells in advance: stretches
        # could run past one, so disaggregated replays step one at a time.
        self._stretches = stretches and prefill_router is None

    def run(
        self, trace: Sequence[TraceRequest], on_finish: Callable[[RequestRecord], None] | None = None
    ) -> list[RequestRecord]:
        """Replay `trace`; `on_finish` hears of each request once, when it finishes or fails."""
        self._on_finish = on_finish
        for w in (*self.workers, *self.prefill_workers):
            w.router.add_worker(w.worker_id, total_blocks=self.config.num_blocks)
            w.router.apply_kv_snapshot(replace(w.core.kv_snapshot(), worker_id=w.worker_id))
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
            elif kind == _HANDOVER:
                assert isinstance(payload, _Handover)
                self._hand_over(now, payload)
            elif kind == _STRETCH_DONE:
                assert isinstance(payload, tuple)
                self._stretch_done(now, *payload)
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
        tokens, hashes = self.tokens.prompt_and_hashes(request, self.config.block_size)
        route = RouteRequest(request_id, len(tokens), hashes)
        work = WorkerRequest(
            request_id=request_id,
            token_ids=tokens,
            max_tokens=request.output_length,
            block_hashes=hashes,
            ignore_eos=True,
        )
        router = self.router
        if self.prefill_router is not None and request.output_length > 1:
            choice = self.disagg.decide(router.candidate(route), self.prefill_router.candidate(route), True)
            if choice.disaggregate:
                router = self.prefill_router
                self._prefilling[request_id] = work
                work = replace(work, prefill_only=True)
                self.disaggregated += 1
        worker = self._by_id[router.select(route).worker_id]
        record.worker_id = worker.worker_id
        self._submit(now, worker, work, record)

    def _submit(
        self,
        now: float,
        worker: _Worker,
        work: WorkerRequest,
        record: RequestRecord,
        arrived: dict[int, Payload] | None = None,
    ) -> None:
        if worker.stretch is not None:
            self._cut_stretch(now, worker)
        try:
            worker.core.add(work, arriving=arrived is not None)
            if arrived is not None:
                worker.core.arrive(work.request_id, arrived)
        except ValueError as exc:
            record.error = str(exc)
            self._prefilling.pop(work.request_id, None)
            self._handed_over.discard(work.request_id)
            worker.router.on_finish(worker.worker_id, work.request_id)
            if self._on_finish is not None:
                self._on_finish(record)
            return
        if not worker.busy:
            self._start_step(now, worker)

    def _start_step(self, now: float, worker: _Worker) -> None:
        if self._stretches and self._take_stretch(now, worker):
            return
        result = worker.core.step()
        if not result.outputs and result.duration_ms == 0.0:
            worker.busy = False  # nothing schedulable until a request arrives
            return
        worker.busy = True
        self._push(now + result.duration_ms, _STEP_DONE, (worker, result))

    def _take_stretch(self, now: float, worker: _Worker) -> bool:
        """Take the worker's next steps at once when they are all the same decode step: the
        same outputs at the same times as stepping them one by one, for one event instead of
        many. They are applied to the core when the stretch ends (`_cut_stretch` may end it
        earlier)."""
        steps, step_ms = worker.core.decode_stretch()
        if not steps:
            return False
        end, _ = _steps_before(now, step_ms, steps, math.inf)
        worker.busy = True
        worker.stretch = stretch = (now, step_ms, steps)
        self._push(end, _STRETCH_DONE, (worker, stretch))
        return True

    def _stretch_done(self, now: float, worker: _Worker, stretch: tuple[float, float, int]) -> None:
        if worker.stretch is not stretch:
            return  # cut short: its own end was queued then
        _, step_ms, steps = stretch
        worker.stretch = None
        self._step_done(now, worker, worker.core.advance(steps, step_ms))

    def _cut_stretch(self, now: float, worker: _Worker) -> None:
        """A request arrives at `now` for a worker in a stretch: the stretch ends with the last
        step that started before `now`, the first step the request could join being the
        next."""
        assert worker.stretch is not None
        start, step_ms, steps = worker.stretch
        end, taken = _steps_before(start, step_ms, steps, now)
        worker.stretch = None  # its queued end no longer counts
        self._push(end, _STEP_DONE, (worker, worker.core.advance(taken, step_ms)))

    def _step_done(self, now: float, worker: _Worker, result: StepResult) -> None:
        for out in result.outputs:
            record = self._records[out.request_id]
            record.emitted(now, len(out.token_ids))
            if out.finish_reason is None:
                continue
            worker.router.on_finish(worker.worker_id, out.request_id)
            decode = self._prefilling.pop(out.request_id, None)
            if decode is not None and out.finish_reason == "length":
                self._prefilled(now, worker, decode, out)
                continue
            record.finish_ms = now
            if out.usage is not None and out.request_id not in self._handed_over:
                record.cached_tokens = out.usage.cached_tokens
            self._handed_over.discard(out.request_id)
            if self._on_finish is not None:
                self._on_finish(record)
        batches = [replace(b, worker_id=worker.worker_id) for b in worker.core.take_kv_events()]
        if batches:
            if self.kv_event_delay_ms > 0:
                self._push(now + self.kv_event_delay_ms, _KV_EVENTS, batches)
            else:
                for batch in batches:
                    self._deliver(batch)
        worker.router.apply_load(replace(worker.core.load(), worker_id=worker.worker_id))
        if worker.core.has_work():
            self._start_step(now, worker)
        else:
            worker.busy = False

    def _prefilled(self, now: float, prefill: _Worker, decode: WorkerRequest, out: RequestOutput) -> None:
        """The prefill's first token is out: the decode goes to a worker of the main pool, and
        starts there when the prompt's KV has crossed."""
        record = self._records[decode.request_id]
        if out.usage is not None:
            record.cached_tokens = out.usage.cached_tokens
        self._handed_over.add(decode.request_id)
        tokens = [*decode.token_ids, *out.token_ids]
        hashes = block_hashes(tokens, self.config.block_size)
        decode = replace(
            decode, generated_token_ids=out.token_ids, block_hashes=hashes, kv_transfer=out.kv_transfer
        )
        worker = self._by_id[
            self.router.select(RouteRequest(decode.request_id, len(tokens), hashes)).worker_id
        ]
        records = prefill.core.read_transfer(decode.request_id) or []
        handover = _Handover(prefill, worker, decode, out.kv_transfer, records)
        self._push(now + worker.core.transfer_ms(len(records)), _HANDOVER, handover)

    def _hand_over(self, now: float, handover: _Handover) -> None:
        handover.prefill.core.release_transfer(handover.request.request_id)
        decode = handover.decode
        arrived = None
        if handover.transfer is not None:
            arrived = decode.core.check_arrived(handover.transfer, handover.records)
        self._submit(now, decode, handover.request, self._records[handover.request.request_id], arrived)

    def _deliver(self, batch: KvEventBatch) -> None:
        worker = self._by_id[batch.worker_id]
        if worker.router.apply_kv_batch(batch):
            # A gap cannot happen in-process; if it ever does, resync as a subscriber would.
            worker.router.apply_kv_snapshot(replace(worker.core.kv_snapshot(), worker_id=batch.worker_id))


def _steps_before(start: float, step_ms: float, steps: int, limit: float) -> tuple[float, int]:
    """(end, count) of the steps of `step_ms` from `start`, up to `steps` of them, that start
    before `limit` (the first always does). The end is added step by step, as one event per
    step would be timed, so a stretch ends at the very time its steps one by one would."""
    end, taken = start + step_ms, 1
    while taken < steps and end < limit:
        end += step_ms
        taken += 1
    return end, taken
