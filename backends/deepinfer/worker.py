"""DeepInfer as a Weir worker: the `orchestrator.runtime.engine.Engine` seam over `AsyncEngine`.

The worker host serves this on the request plane, registers `card` in discovery and publishes
`take_kv_events()` and `load()` on the event plane. Loading weights and sizing the KV cache
happen in `start()`, off the event loop. DeepInfer's command-line flags live in `args.py`,
which does not import torch.
"""

from __future__ import annotations

import asyncio

from backends.deepinfer.args import add_deepinfer_arguments, deepinfer_config_from_args
from backends.deepinfer.async_engine import AsyncEngine
from backends.deepinfer.config import EngineConfig
from backends.deepinfer.engine import Engine
from orchestrator.runtime.engine import ArrivingKv, DeltaStream
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import (
    KvEventBatch,
    KvSnapshot,
    LoadReport,
    ModelCard,
    WorkerRequest,
)


class DeepInferWorker:
    """One DeepInfer engine behind the runtime's `Engine` protocol (role `aggregated`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._async: AsyncEngine | None = None
        self._card: ModelCard | None = None
        self._last_event_id = 0

    @property
    def engine(self) -> Engine:
        if self._async is None:
            raise EngineError("unavailable", "the DeepInfer worker has not been started", retryable=True)
        return self._async.engine

    @property
    def card(self) -> ModelCard:
        if self._card is None:
            raise EngineError("unavailable", "the DeepInfer worker has not been started", retryable=True)
        return self._card

    async def start(self) -> None:
        if self._async is not None:
            return
        engine = await asyncio.to_thread(Engine, self.config)
        self._card = ModelCard(
            name=engine.name,
            model_path=str(engine.model_dir),
            context_length=engine.max_model_len,
            block_size=self.config.block_size,
            kv_bytes_per_token=engine.kv_bytes_per_token,
            role="aggregated",
            backend="deepinfer",
            total_kv_blocks=engine.scheduler.kv_cache.num_blocks,
            max_num_seqs=self.config.max_num_seqs,
            eos_token_ids=engine.eos_token_ids,
            vocab_size=engine.vocab_size,
            kv_tiers=engine.tiers.capacities() if engine.tiers is not None else {},
        )
        self._async = AsyncEngine(engine)
        await self._async.start()

    async def stop(self) -> None:
        if self._async is not None:
            await self._async.stop()
            tiers = self._async.engine.tiers
            if tiers is not None:
                await asyncio.to_thread(tiers.close)  # the transfer thread finishes its queue

    def generate(self, request: WorkerRequest, arriving_kv: ArrivingKv | None = None) -> DeltaStream:
        if self._async is None:
            raise EngineError("unavailable", "the DeepInfer worker has not been started", retryable=True)
        return self._async.generate(request, arriving_kv)

    def read_transfer(self, transfer_id: str) -> list[bytes] | None:
        return self.engine.read_transfer(transfer_id)

    def release_transfer(self, transfer_id: str) -> None:
        self.engine.release_transfer(transfer_id)

    def load(self) -> LoadReport:
        engine = self.engine
        with engine.lock:
            report = engine.scheduler.load()
            report.step_time = engine.step_fit.curves()
            return report

    def take_kv_events(self) -> list[KvEventBatch]:
        engine = self.engine
        with engine.lock:
            return engine.scheduler.kv_cache.take_events()

    def kv_snapshot(self) -> KvSnapshot:
        engine = self.engine
        with engine.lock:
            return engine.scheduler.kv_cache.snapshot()


# The flags moved to args.py (no torch); importing them from here keeps working.
__all__ = ["DeepInferWorker", "add_deepinfer_arguments", "deepinfer_config_from_args"]
