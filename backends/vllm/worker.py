"""`VllmWorker`: vLLM's `AsyncLLM` behind Weir's `Engine` protocol.

vLLM runs its engine core (scheduler, KV cache, model) in processes of its own; `AsyncLLM`
is the client in this one. `start()` has vLLM publish its KV events on ipc:// endpoints in a
private directory and, once vLLM has chosen its block size, subscribes a `ZmqKvEvents` there
(nothing is cached before the first request; a frame missed anyway is replayed), so the
router's index follows vLLM's own cache, evictions included. Load comes from a stat logger vLLM calls
with its scheduler's stats after each step; vLLM's own periodic stat lines stay off.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from vllm import SamplingParams
from vllm.config.kv_events import KVEventsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError, RetryableRequestError, VLLMClientError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import SchedulerStats

from backends.adapter import AggregatedAdapter, block_size_mismatch, model_eos_ids
from backends.kv_events import KvMirror, ZmqKvEvents
from backends.vllm.params import DeltaMaker, prompt, sampling_kwargs
from orchestrator.runtime.engine import ArrivingKv, DeltaStream
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import (
    LoadReport,
    ModelCard,
    TokenDelta,
    WorkerRequest,
)

log = logging.getLogger(__name__)


class _SchedulerLoad(StatLoggerBase):
    """Keeps the last scheduler stats vLLM recorded; `VllmWorker.load` reads them."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.stats = SchedulerStats()

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self.stats = scheduler_stats

    def log_engine_initialized(self) -> None:
        pass


class VllmWorker(AggregatedAdapter):
    """One vLLM engine serving one model, role `aggregated`."""

    engine_name = "vLLM"

    def __init__(self, engine_args: dict[str, Any], served_name: str) -> None:
        super().__init__()
        self.engine_args = engine_args
        self.served_name = served_name
        self._llm: AsyncLLM | None = None
        self._events: ZmqKvEvents | None = None
        self._stats = _SchedulerLoad(None)
        self._dir: str | None = None

    async def start(self) -> None:
        if self._llm is not None:
            return
        self._dir = tempfile.mkdtemp(prefix="weir-vllm-")  # mode 0700: only this user connects
        endpoint, replay = f"ipc://{self._dir}/kv", f"ipc://{self._dir}/kv-replay"
        args = AsyncEngineArgs(
            **self.engine_args,
            disable_log_stats=True,  # vLLM's periodic log lines; our stat logger still runs
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=replay
            ),
        )
        # Starting vLLM's processes and loading weights blocks for seconds: not on the loop.
        llm = await asyncio.to_thread(
            AsyncLLM.from_engine_args, args, stat_loggers=[lambda config, index=0: self._stats]
        )
        config = llm.vllm_config
        block_size = config.cache_config.block_size
        mismatch = block_size_mismatch("vLLM", block_size, self.engine_args.get("block_size"))
        if mismatch is not None:
            llm.shutdown()
            raise EngineError("internal", mismatch)
        if not config.cache_config.enable_prefix_caching:
            log.warning("vLLM runs without prefix caching here: the router gets no KV events")
        self._events = ZmqKvEvents(endpoint, replay, KvMirror(block_size))
        self._mirror = self._events.mirror
        self._card = _card(llm, self.served_name)
        self._llm = llm

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
        if self._events is not None:
            self._events.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def generate(self, request: WorkerRequest, arriving_kv: ArrivingKv | None = None) -> DeltaStream:
        return self._generate(request)

    async def _generate(self, request: WorkerRequest) -> AsyncGenerator[TokenDelta, None]:
        llm = self._llm
        if llm is None:
            raise EngineError("unavailable", "the vLLM worker is not running", retryable=True)
        kwargs = sampling_kwargs(request)
        guided = kwargs.pop("structured_outputs", None)
        try:
            params = SamplingParams(
                **kwargs,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=StructuredOutputsParams(**guided) if guided else None,
            )
        except ValueError as exc:
            raise EngineError("invalid_request", str(exc)) from exc
        rid = request.request_id
        maker = DeltaMaker(request)
        self._waiting_first[rid] = len(request.token_ids) + len(request.generated_token_ids)
        try:
            outputs = llm.generate(
                TokensPrompt(**prompt(request)),
                params,
                rid,
                priority=request.priority,
            )
            # Closing this generator closes vLLM's, which aborts the request and frees its KV.
            async for out in outputs:
                self._waiting_first.pop(rid, None)
                yield maker.delta(out)
        except EngineError:
            raise
        except Exception as exc:
            raise engine_error(exc) from exc
        finally:
            self._waiting_first.pop(rid, None)

    def load(self) -> LoadReport:
        stats = self._stats.stats
        total = self.card.total_kv_blocks
        return LoadReport(
            worker_id="",
            active_requests=stats.num_running_reqs,
            waiting_requests=stats.num_waiting_reqs + stats.num_skipped_waiting_reqs,
            active_blocks=round(stats.kv_cache_usage * total),
            total_blocks=total,
            queued_prefill_tokens=self.queued_prefill_tokens,
        )

    def _poll_events(self) -> None:
        if self._events is not None:
            self._events.poll()


def engine_error(exc: Exception) -> EngineError:
    """A vLLM failure as Weir's one error type: whether another worker may take the request."""
    if isinstance(exc, VLLMClientError | ValueError | TypeError):  # its input checks
        return EngineError("invalid_request", str(exc))
    if isinstance(exc, QueueOverflowError | MaxQueuedTokensError):
        return EngineError("overloaded", str(exc), retryable=True)
    if isinstance(exc, EngineDeadError):
        return EngineError("unavailable", f"vLLM's engine died: {exc}", retryable=True)
    return EngineError("internal", f"vLLM failed: {exc!r}", retryable=isinstance(exc, RetryableRequestError))


def _card(llm: AsyncLLM, served_name: str) -> ModelCard:
    config = llm.vllm_config
    model = config.model_config
    model_dir = Path(model.model)
    layers = model.get_num_layers(config.parallel_config)
    kv_heads = model.get_num_kv_heads(config.parallel_config)
    itemsize = (
        model.dtype.itemsize
        if config.cache_config.cache_dtype == "auto"
        else _dtype_size(config.cache_config.cache_dtype)
    )
    # MLA caches one latent per token and layer; others a key and a value per KV head.
    per_layer = model.get_head_size() * (1 if model.use_mla else 2 * kv_heads)
    return ModelCard(
        name=served_name,
        model_path=str(model_dir),
        context_length=model.max_model_len,
        block_size=config.cache_config.block_size,
        kv_bytes_per_token=layers * per_layer * itemsize,
        role="aggregated",
        backend="vllm",
        total_kv_blocks=config.cache_config.num_gpu_blocks or 0,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        eos_token_ids=model_eos_ids(model_dir),
        vocab_size=model.get_vocab_size(),
    )


def _dtype_size(cache_dtype: str) -> int:
    return 1 if cache_dtype.startswith("fp8") else 2
