"""DeepInfer as a Weir worker: the `orchestrator.runtime.engine.Engine` seam over `AsyncEngine`.

The worker host serves this on the request plane, registers `card` in discovery and publishes
`take_kv_events()` and `load()` on the event plane. Loading weights and sizing the KV cache
happen in `start()`, off the event loop. The CLI helpers at the bottom give `weir serve` and
`weir worker` the same DeepInfer flags.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from backends.deepinfer.async_engine import AsyncEngine
from backends.deepinfer.config import EngineConfig
from backends.deepinfer.engine import Engine
from orchestrator.runtime.engine import EngineError
from orchestrator.runtime.protocol import (
    KvEventBatch,
    KvSnapshot,
    LoadReport,
    ModelCard,
    TokenDelta,
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
            name=self.config.served_model_name or Path(self.config.model).name,
            model_path=str(engine.model_dir),
            context_length=engine.max_model_len,
            block_size=self.config.block_size,
            kv_bytes_per_token=engine.kv_bytes_per_token,
            role="aggregated",
            backend="deepinfer",
            total_kv_blocks=engine.scheduler.block_manager.num_blocks,
            max_num_seqs=self.config.max_num_seqs,
            eos_token_ids=engine.eos_token_ids,
        )
        self._async = AsyncEngine(engine)
        await self._async.start()

    async def stop(self) -> None:
        if self._async is not None:
            await self._async.stop()

    def generate(self, request: WorkerRequest) -> AsyncIterator[TokenDelta]:
        if self._async is None:
            raise EngineError("unavailable", "the DeepInfer worker has not been started", retryable=True)
        return self._async.generate(request)

    def load(self) -> LoadReport:
        engine = self.engine
        with engine.lock:
            scheduler = engine.scheduler
            return LoadReport(
                worker_id="",
                active_requests=scheduler.num_running,
                waiting_requests=scheduler.num_waiting,
                active_blocks=scheduler.block_manager.num_active_blocks,
                total_blocks=scheduler.block_manager.num_blocks,
                queued_prefill_tokens=scheduler.queued_prefill_tokens(),
                kv_event_id=self._last_event_id,
            )

    def take_kv_events(self) -> list[KvEventBatch]:
        engine = self.engine
        with engine.lock:
            batches = engine.scheduler.block_manager.take_events()
        if batches:
            self._last_event_id = batches[-1].event_id
        return batches

    def kv_snapshot(self) -> KvSnapshot:
        engine = self.engine
        with engine.lock:
            return engine.scheduler.block_manager.snapshot()


# ---------------------------------------------------------------------- CLI


def add_deepinfer_arguments(parser: argparse.ArgumentParser) -> None:
    """DeepInfer's flags, in their own group; defaults are `EngineConfig`'s."""
    d = EngineConfig()
    g = parser.add_argument_group("DeepInfer engine")
    g.add_argument(
        "--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct, converted once)"
    )
    g.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: the directory name)"
    )
    g.add_argument(
        "--block-size", type=int, default=d.block_size, help=f"tokens per KV block (default {d.block_size})"
    )
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=d.num_kv_blocks,
        help="KV blocks; 0 sizes from --kv-cache-memory-gb",
    )
    g.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=d.kv_cache_memory_gb,
        help=f"KV cache size (default {d.kv_cache_memory_gb})",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help=f"running sequences (default {d.max_num_seqs})",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help=f"tokens per step (default {d.max_num_batched_tokens})",
    )
    g.add_argument(
        "--max-model-len", type=int, default=d.max_model_len, help="context limit (0: the checkpoint's)"
    )
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N (default auto)")
    g.add_argument(
        "--dtype",
        default=d.dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant numerics: seeded requests ignore their batch",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--seed", type=int, default=d.seed, help="seed for unseeded sampling")


def deepinfer_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """An `EngineConfig` from the flags above; converts the default model on first use."""
    if args.model:
        model = Path(args.model)
    else:
        from backends.deepinfer.smollm2 import ensure_default_model

        model = ensure_default_model()
    if not (model / "config.json").is_file():
        raise ValueError(f"--model {model} is not a checkpoint directory (no config.json)")
    return EngineConfig(
        model=str(model),
        served_model_name=args.served_model_name or "",
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        deterministic=args.deterministic,
        seed=args.seed,
    )
