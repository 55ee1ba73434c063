"""asyncio front of the engine: the step loop runs in its own thread, requests stream deltas.

The thread steps while there is work and sleeps on an event otherwise. After each step it
turns the step's outputs into `TokenDelta`s (off the event loop) and hands them over in one
`call_soon_threadsafe`, which puts each into its request's queue. A consumer that falls behind
finds several deltas waiting and receives them merged into one, so slow clients cost one
message per read, not one per token.

Torch releases the GIL inside its kernels, so the event loop keeps serving HTTP and the
request plane while a forward runs. Closing a `generate` iterator aborts the request: its
blocks are freed right away (see `Engine.abort`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, Callable

from backends.deepinfer.engine import Engine
from backends.deepinfer.outputs import SeqOutput
from backends.deepinfer.sequence import Sequence
from orchestrator.runtime.engine import ArrivingKv
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import (
    FinishReason,
    KvTransfer,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerRequest,
    merge_deltas,
)

logger = logging.getLogger(__name__)

_Item = TokenDelta | EngineError
_IDLE_POLL_S = 0.005


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._streams: dict[str, asyncio.Queue[_Item]] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="deepinfer-step", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop stepping; requests still in flight end with finish_reason 'abort'."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        for request_id, queue in list(self._streams.items()):
            seq = self.engine.abort(request_id)
            if seq is not None:
                queue.put_nowait(TokenDelta(finish_reason="abort", usage=_usage(seq)))

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ requests

    async def generate(
        self, request: WorkerRequest, arriving_kv: ArrivingKv | None = None
    ) -> AsyncGenerator[TokenDelta, None]:
        """Stream one request's deltas; the last carries finish_reason and usage (and, for a
        prefill-only request, the KV it holds). `arriving_kv`: see `Engine.generate`; the
        request waits in the engine's queue, as LOADING_KV, while it comes."""
        if self._thread is None:
            raise EngineError("unavailable", "the engine is not running", retryable=True)
        rid = request.request_id
        if rid in self._streams:
            raise EngineError("invalid_request", f"request id {rid!r} is already in use")
        try:
            grammar = (
                await asyncio.to_thread(self.engine.compile_grammar, request) if request.guided else None
            )
            queue: asyncio.Queue[_Item] = asyncio.Queue()
            self._streams[rid] = queue
            transfer = request.kv_transfer if arriving_kv is not None else None
            self.engine.add(request, grammar, arriving=transfer is not None)
        except ValueError as exc:
            self._streams.pop(rid, None)
            raise EngineError("invalid_request", str(exc)) from exc
        self._wakeup.set()
        finished = False
        try:
            if transfer is not None and arriving_kv is not None:
                records = await arriving_kv
                arrived = await asyncio.to_thread(self.engine.check_arrived, transfer, records)
                self.engine.arrive(rid, arrived)
                self._wakeup.set()
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                errors = [i for i in items if isinstance(i, EngineError)]
                deltas = [i for i in items if isinstance(i, TokenDelta)]
                if deltas:
                    delta = merge_deltas(deltas)
                    finished = delta.finish_reason is not None
                    yield delta
                if errors:
                    finished = True
                    raise errors[0]
        finally:
            self._streams.pop(rid, None)
            if not finished:  # the consumer went away (closed the iterator, or was cancelled)
                self.engine.abort(rid)

    # ------------------------------------------------------------------ the step thread

    def _run(self) -> None:
        while not self._stopping:
            self._wakeup.clear()
            if not self.engine.has_unfinished():
                self._wakeup.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug or a device failure: fail the requests, keep serving
                logger.exception("DeepInfer step failed")
                self._fail_all(f"the engine failed: {exc}")
                continue
            if outputs:
                batch = [(o.seq.request_id, _delta(o, self._transfer(o))) for o in outputs]
                self._call_soon(self._deliver, batch)
            elif self.engine.last_step_tokens == 0:
                # Work exists but none could be scheduled: wait for a change, do not spin.
                self._wakeup.wait(_IDLE_POLL_S)

    def _transfer(self, o: SeqOutput) -> KvTransfer | None:
        if o.finished and o.seq.request.prefill_only:
            return self.engine.transfer(o.seq.request_id)
        return None

    def _deliver(self, batch: list[tuple[str, TokenDelta]]) -> None:
        for request_id, delta in batch:
            queue = self._streams.get(request_id)
            if queue is not None:
                queue.put_nowait(delta)

    def _fail_all(self, message: str) -> None:
        request_ids = list(self._streams)
        for request_id in request_ids:
            self.engine.abort(request_id)

        def fail() -> None:
            for request_id in request_ids:
                queue = self._streams.get(request_id)
                if queue is not None:
                    queue.put_nowait(EngineError("internal", message))

        self._call_soon(fail)

    def _call_soon(self, callback: Callable[..., object], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed under us: nobody is listening any more
            self._stopping = True


# ---------------------------------------------------------------------- deltas


def _usage(seq: Sequence) -> Usage:
    return Usage(
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=seq.num_completion_tokens,
        cached_tokens=seq.num_cached_tokens,
        accepted_draft_tokens=seq.num_accepted_tokens,
        rejected_draft_tokens=seq.num_draft_tokens - seq.num_accepted_tokens,
    )


def _delta(o: SeqOutput, transfer: KvTransfer | None) -> TokenDelta:
    seq = o.seq
    logprobs = None
    if seq.request.logprobs is not None:
        logprobs = [
            TokenLogprob(t.token_id, t.logprob or 0.0, [TopLogprob(i, lp) for i, lp in t.top or ()])
            for t in o.new_tokens
        ]
    reason: FinishReason | None = seq.finish_reason if o.finished else None  # type: ignore[assignment]
    return TokenDelta(
        token_ids=[t.token_id for t in o.new_tokens],
        logprobs=logprobs,
        finish_reason=reason,
        usage=_usage(seq) if o.finished else None,
        # The first delta says how much of the prompt came from the cache, so the frontend
        # can report it even when a stop string cancels the request before the final usage.
        cached_tokens=seq.num_cached_tokens if seq.num_completion_tokens == len(o.new_tokens) else None,
        kv_transfer=transfer,
    )
