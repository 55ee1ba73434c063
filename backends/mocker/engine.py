"""`MockerEngine`: the mocker as a Weir `Engine`, paced in wall-clock time.

One asyncio task steps the `MockerCore` and waits out each step's simulated duration
divided by `speedup`, then hands the step's tokens to the requests' streams. A stream
collects what arrived since its consumer last looked, so tokens ready together leave as
one `TokenDelta`. Closing a request's iterator aborts it in the core, freeing its blocks.
Engines share nothing, so any number can run on one event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from backends.deepinfer.sequence import Sequence
from backends.mocker.config import MockerConfig
from backends.mocker.core import MockerCore, RequestOutput
from orchestrator.runtime.engine import ArrivingKv
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import (
    FinishReason,
    KvEventBatch,
    KvSnapshot,
    KvTransfer,
    LoadReport,
    ModelCard,
    TokenDelta,
    Usage,
    WorkerRequest,
)

log = logging.getLogger(__name__)


class _Stream:
    """One request's pending output, drained by its consumer."""

    __slots__ = ("error", "finish_reason", "first", "kv_transfer", "ready", "seq", "token_ids", "usage")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.first = True
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.usage: Usage | None = None
        self.kv_transfer: KvTransfer | None = None
        self.error: EngineError | None = None
        self.ready = asyncio.Event()

    def push(self, out: RequestOutput) -> None:
        self.token_ids += out.token_ids
        if out.finish_reason is not None:
            self.finish_reason, self.usage, self.kv_transfer = out.finish_reason, out.usage, out.kv_transfer
        self.ready.set()

    def fail(self, error: EngineError) -> None:
        self.error = error
        self.ready.set()

    async def next(self) -> TokenDelta:
        await self.ready.wait()
        self.ready.clear()
        if self.error is not None:
            raise self.error
        delta = TokenDelta(
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            usage=self.usage,
            kv_transfer=self.kv_transfer,
        )
        if self.first:  # the prefix cache was looked up when the prompt was scheduled
            self.first = False
            delta.cached_tokens = self.seq.num_cached_tokens
        self.token_ids = []
        return delta


class MockerEngine:
    def __init__(self, config: MockerConfig | None = None) -> None:
        self.config = config or MockerConfig()
        self.core = MockerCore(self.config)
        self._card = ModelCard(
            name=self.config.model_name,
            model_path=self.config.model_path,
            context_length=self.config.context_length,
            block_size=self.config.block_size,
            backend="mocker",
            total_kv_blocks=self.config.num_blocks,
            max_num_seqs=self.config.max_num_seqs,
            eos_token_ids=list(self.config.eos_token_ids),
            vocab_size=self.config.vocab_size,
            kv_tiers=self.core.tiers.capacities() if self.core.tiers is not None else {},
        )
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def card(self) -> ModelCard:
        return self._card

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"mocker-{self.config.model_name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for request_id, stream in list(self._streams.items()):
            final = self.core.abort(request_id)
            if final is not None:
                stream.push(final)

    async def generate(
        self, request: WorkerRequest, arriving_kv: ArrivingKv | None = None
    ) -> AsyncGenerator[TokenDelta, None]:
        if self._task is None:
            raise EngineError("unavailable", "the mocker engine is not running", retryable=True)
        transfer = request.kv_transfer if arriving_kv is not None else None
        try:
            seq = self.core.add(request, arriving=transfer is not None)
        except ValueError as exc:
            raise EngineError("invalid_request", str(exc)) from None
        stream = self._streams[request.request_id] = _Stream(seq)
        self._wake.set()
        finished = False
        try:
            if transfer is not None and arriving_kv is not None:
                arrived = self.core.check_arrived(transfer, await arriving_kv)
                # The KV's trip from the prefill worker, simulated: the other requests step meanwhile.
                await asyncio.sleep(self.core.transfer_ms(len(arrived)) / (1000.0 * self.config.speedup))
                self.core.arrive(request.request_id, arrived)
                self._wake.set()
            while not finished:
                delta = await stream.next()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            del self._streams[request.request_id]
            if not finished:  # the caller went away: free the blocks now
                self.core.abort(request.request_id)
                self._wake.set()

    def read_transfer(self, transfer_id: str) -> list[bytes] | None:
        return self.core.read_transfer(transfer_id)

    def release_transfer(self, transfer_id: str) -> None:
        self.core.release_transfer(transfer_id)
        self._wake.set()  # a request waiting for blocks may fit now

    def load(self) -> LoadReport:
        return self.core.load()

    def take_kv_events(self) -> list[KvEventBatch]:
        return self.core.take_kv_events()

    def kv_snapshot(self) -> KvSnapshot:
        return self.core.kv_snapshot()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        scale = 1.0 / (1000.0 * self.config.speedup)
        deadline = loop.time()
        try:
            while True:
                if not self.core.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    deadline = loop.time()
                    continue
                result = self.core.step()
                if not result.outputs and not result.duration_ms:
                    # Work exists but none can run (its KV is arriving, or the blocks it needs
                    # are held for a transfer): wait for a change (an arrival, a release, an
                    # abort or a new request sets _wake).
                    self._wake.clear()
                    await self._wake.wait()
                    deadline = loop.time()
                    continue
                # Sleep to a deadline, not for a duration, so timer lateness does not accumulate.
                deadline = max(deadline + result.duration_ms * scale, loop.time() - 0.05)
                await asyncio.sleep(deadline - loop.time())
                for out in result.outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.push(out)
        except Exception as exc:  # a bug here must fail every request, not hang them
            log.exception("mocker step loop failed")
            self._task = None  # later requests are refused instead of queued forever
            for stream in self._streams.values():
                stream.fail(EngineError("internal", f"mocker engine failed: {exc}"))
