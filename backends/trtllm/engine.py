"""`TrtllmWorker`: TensorRT-LLM's `LLM` behind Weir's `Engine` protocol.

TensorRT-LLM runs its executor (scheduler, KV cache manager, model) in worker processes of
its own; `LLM` is the client in this one. Its KV cache events are not published on a socket:
`LLM.get_kv_cache_events_async` yields them as dicts (with `enable_block_reuse` and an event
buffer in its KvCacheConfig), and a task of the adapter's turns each into Weir's events
(`params.kv_fields`) in a `KvMirror`. Load comes the same way, from the iteration stats
`LLM.get_stats_async` yields (with `enable_iter_perf_stats`): active and queued requests and
the KV blocks in use out of the pool's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import KvCacheConfig
from tensorrt_llm.sampling_params import GuidedDecodingParams

from backends.adapter import AggregatedAdapter, block_size_mismatch, model_eos_ids, prompt_tokens
from backends.kv_events import KvMirror
from backends.trtllm.params import DeltaMaker, kv_fields, priority, sampling_kwargs
from orchestrator.runtime.engine import ArrivingKv, DeltaStream
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import (
    LoadReport,
    ModelCard,
    TokenDelta,
    WorkerRequest,
)

log = logging.getLogger(__name__)

# Events TensorRT-LLM buffers between two reads of the adapter's; past it, it drops the oldest
# (and the router misses blocks until they are stored again).
_EVENT_BUFFER = 65_536
# How long one get_*_async iteration waits for the next item before it ends and is renewed.
_POLL_S = 1.0


class TrtllmWorker(AggregatedAdapter):
    """One TensorRT-LLM engine serving one model, role `aggregated`."""

    engine_name = "TensorRT-LLM"

    def __init__(self, llm_args: dict[str, Any], served_name: str) -> None:
        super().__init__()
        self.llm_args = llm_args
        self.served_name = served_name
        self._llm: Any = None
        self._stats: dict[str, Any] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        if self._llm is not None:
            return
        model_dir = Path(self.llm_args["model"])
        kv = KvCacheConfig(
            **self.llm_args.get("kv_cache_config", {}),
            enable_block_reuse=True,
            event_buffer_max_size=_EVENT_BUFFER,
        )
        args = {
            **self.llm_args,
            "kv_cache_config": kv,
            "skip_tokenizer_init": True,
            "enable_iter_perf_stats": True,
        }
        # Starting TensorRT-LLM's workers and loading weights blocks for seconds: not on the loop.
        llm = await asyncio.to_thread(LLM, **args)
        block_size = llm.args.kv_cache_config.tokens_per_block
        wanted = self.llm_args.get("kv_cache_config", {}).get("tokens_per_block")
        mismatch = block_size_mismatch("TensorRT-LLM", block_size, wanted)
        if mismatch is not None:
            llm.shutdown()
            raise EngineError("internal", mismatch)
        self._card = _card(llm, model_dir, self.served_name, block_size)
        self._mirror = KvMirror(block_size)
        self._llm = llm
        self._tasks = [
            asyncio.create_task(self._pump_events(llm), name="trtllm-kv-events"),
            asyncio.create_task(self._pump_stats(llm), name="trtllm-stats"),
        ]

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if llm is not None:
            # Ends in-flight requests: their streams finish as "cancelled", an abort.
            await asyncio.to_thread(llm.shutdown)

    async def _pump_events(self, llm: Any) -> None:
        """Feeds TensorRT-LLM's KV events to the mirror as they come. Each iteration ends when
        none came for `_POLL_S`; the next one picks up where it stopped."""
        while True:
            async for event in llm.get_kv_cache_events_async(timeout=_POLL_S):
                assert self._mirror is not None
                self._mirror.apply(kv_fields([event]))

    async def _pump_stats(self, llm: Any) -> None:
        """Keeps the last iteration stats (a dict, or its JSON text in older releases)."""
        while True:
            async for stat in llm.get_stats_async(timeout=_POLL_S):
                self._stats = json.loads(stat) if isinstance(stat, str) else dict(stat)

    def generate(self, request: WorkerRequest, arriving_kv: ArrivingKv | None = None) -> DeltaStream:
        return self._generate(request)

    async def _generate(self, request: WorkerRequest) -> AsyncGenerator[TokenDelta, None]:
        llm = self._llm
        if llm is None:
            raise EngineError("unavailable", "the TensorRT-LLM worker is not running", retryable=True)
        kwargs = sampling_kwargs(request, self.card.eos_token_ids)
        guided = kwargs.pop("guided_decoding", None)
        try:
            params = SamplingParams(
                **kwargs, guided_decoding=GuidedDecodingParams(**guided) if guided else None
            )
        except (ValueError, TypeError) as exc:
            raise EngineError("invalid_request", str(exc)) from exc
        # Passed only when set: releases before they existed take neither.
        extra: dict[str, Any] = {}
        if request.priority:
            extra["priority"] = priority(request)
        if request.cache_salt:
            extra["cache_salt"] = request.cache_salt
        rid = request.request_id
        tokens = prompt_tokens(request)
        maker = DeltaMaker(request)
        result = None
        finished = False
        self._waiting_first[rid] = len(tokens)
        try:
            result = llm.generate_async(tokens, sampling_params=params, streaming=True, **extra)
            async for out in result:
                self._waiting_first.pop(rid, None)
                delta = maker.delta(out)
                finished = delta.finish_reason is not None
                yield delta
        except EngineError:
            raise
        except (ValueError, TypeError) as exc:  # the LLM's input checks (length, ids, params)
            raise EngineError("invalid_request", str(exc)) from exc
        except Exception as exc:
            raise EngineError("internal", f"TensorRT-LLM failed the request: {exc}") from exc
        finally:
            self._waiting_first.pop(rid, None)
            if result is not None and not finished:  # closed early or failed: free its blocks
                result.abort()

    def load(self) -> LoadReport:
        kv = self._stats.get("kvCacheStats") or {}
        return LoadReport(
            worker_id="",
            active_requests=int(self._stats.get("numActiveRequests", 0)),
            waiting_requests=int(self._stats.get("numQueuedRequests", 0)),
            active_blocks=int(kv.get("usedNumBlocks", 0)),
            total_blocks=int(kv.get("maxNumBlocks", self.card.total_kv_blocks)),
            queued_prefill_tokens=self.queued_prefill_tokens,
        )


def _card(llm: Any, model_dir: Path, served_name: str, block_size: int) -> ModelCard:
    """The card, from the model's config.json where the LLM does not say. The pool's size is
    not known before TensorRT-LLM's first iteration stats: the card says 0 (not known) and
    load reports carry it."""
    config = json.loads((model_dir / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv_dtype = str(llm.args.kv_cache_config.dtype or "auto")
    itemsize = 1 if "fp8" in kv_dtype else 2
    return ModelCard(
        name=served_name,
        model_path=str(model_dir),
        context_length=int(llm.args.max_seq_len or config.get("max_position_embeddings") or 4096),
        block_size=block_size,
        kv_bytes_per_token=layers * 2 * kv_heads * head_dim * itemsize,
        role="aggregated",
        backend="trtllm",
        total_kv_blocks=0,
        max_num_seqs=int(llm.args.max_batch_size or 0),
        eos_token_ids=model_eos_ids(model_dir),
        vocab_size=int(config.get("vocab_size") or 0),
    )
