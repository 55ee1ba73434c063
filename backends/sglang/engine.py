"""`SglangWorker`: SGLang's offline `sglang.Engine` behind Weir's `Engine` protocol.

SGLang runs its scheduler (KV cache, model) and detokenizer in processes of its own; its
tokenizer manager, in this one, is what `Engine.async_generate` talks to. `start()` launches
SGLang with its ZMQ KV event publisher bound to ipc:// endpoints in a private directory and
subscribes a `ZmqKvEvents` to them, so the router's index follows SGLang's radix cache,
evictions included.

Load comes from SGLang's load snapshots, which each scheduler writes to shared memory
(prefill and idle steps at once, decode every --load-snapshot-publish-interval steps): the
source of SGLang's /v1/loads, read through the tokenizer manager's `load_snapshot_reader`
(running and waiting requests, uncached prompt tokens waiting, KV tokens in use).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import threading
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import sglang

from backends.adapter import AggregatedAdapter, block_size_mismatch, model_eos_ids
from backends.kv_events import KvMirror, ZmqKvEvents
from backends.sglang.params import DeltaMaker, generate_kwargs
from orchestrator.runtime.engine import ArrivingKv, DeltaStream
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import (
    LoadReport,
    ModelCard,
    TokenDelta,
    WorkerRequest,
)

log = logging.getLogger(__name__)

# How long stop() lets aborted requests deliver their last delta before SGLang goes down.
_ABORT_GRACE_S = 5.0


class SglangWorker(AggregatedAdapter):
    """One SGLang engine serving one model, role `aggregated`."""

    engine_name = "SGLang"

    def __init__(self, server_args: dict[str, Any], served_name: str) -> None:
        super().__init__()
        self.server_args = server_args
        self.served_name = served_name
        self._engine: Any = None
        self._events: ZmqKvEvents | None = None
        self._dir: str | None = None
        self._active: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        if self._engine is not None:
            return
        self._dir = tempfile.mkdtemp(prefix="weir-sglang-")  # mode 0700: only this user connects
        endpoint, replay = f"ipc://{self._dir}/kv", f"ipc://{self._dir}/kv-replay"
        args = {
            "log_level": "warning",
            **self.server_args,
            "kv_events_config": json.dumps(
                {"publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay, "topic": ""}
            ),
            "incremental_streaming_output": False,
            "skip_tokenizer_init": False,
        }
        # Launching SGLang's processes and loading weights blocks for seconds: not on the loop.
        # Off the main thread SGLang also leaves this process's signal handlers alone.
        engine = await asyncio.to_thread(sglang.Engine, **args)
        page_size = engine.server_args.page_size
        mismatch = block_size_mismatch("SGLang", page_size, self.server_args.get("page_size"))
        if mismatch is not None:
            engine.shutdown()
            raise EngineError("internal", mismatch)
        if engine.server_args.disable_radix_cache:
            log.warning("SGLang runs without its radix cache here: the router gets no KV events")
        _start_output_loop(engine.tokenizer_manager)
        self._events = ZmqKvEvents(endpoint, replay, KvMirror(page_size))
        self._mirror = self._events.mirror
        self._card = _card(engine, self.served_name)
        self._engine = engine

    async def stop(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            # In-flight requests end with finish_reason "abort" (a plain abort, no status).
            engine.tokenizer_manager.abort_request(abort_all=True)
            try:
                await asyncio.wait_for(self._idle.wait(), _ABORT_GRACE_S)
            except TimeoutError:
                log.warning("%d SGLang requests did not end within %.0f s", len(self._active), _ABORT_GRACE_S)
            await asyncio.to_thread(engine.shutdown)
        if self._events is not None:
            self._events.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def generate(self, request: WorkerRequest, arriving_kv: ArrivingKv | None = None) -> DeltaStream:
        return self._generate(request)

    async def _generate(self, request: WorkerRequest) -> AsyncGenerator[TokenDelta, None]:
        engine = self._engine
        if engine is None:
            raise EngineError("unavailable", "the SGLang worker is not running", retryable=True)
        kwargs = generate_kwargs(request)
        maker = DeltaMaker(request)
        rid = request.request_id
        finished = False
        self._active.add(rid)
        self._idle.clear()
        try:
            outputs = await engine.async_generate(**kwargs, stream=True)
            async for out in outputs:
                delta = maker.delta(out)
                finished = delta.finish_reason is not None
                yield delta
        except EngineError:
            raise
        except ValueError as exc:  # the tokenizer manager's input checks (length, params)
            raise EngineError("invalid_request", str(exc)) from exc
        except Exception as exc:
            raise EngineError("internal", f"SGLang failed the request: {exc}") from exc
        finally:
            if not finished:  # closed early or failed: free its KV blocks at once
                engine.tokenizer_manager.abort_request(rid=rid)
            self._active.discard(rid)
            if not self._active:
                self._idle.set()

    def load(self) -> LoadReport:
        card = self.card
        engine = self._engine
        snapshots = engine.tokenizer_manager.load_snapshot_reader.read_all() if engine is not None else []
        return LoadReport(
            worker_id="",
            active_requests=sum(s.num_running_reqs for s in snapshots),
            waiting_requests=sum(s.num_waiting_reqs for s in snapshots),
            active_blocks=sum(s.num_used_tokens for s in snapshots) // card.block_size,
            total_blocks=card.total_kv_blocks,
            queued_prefill_tokens=sum(s.num_waiting_uncached_tokens for s in snapshots),
        )

    def _poll_events(self) -> None:
        if self._events is not None:
            self._events.poll()


def _start_output_loop(tokenizer_manager: Any) -> None:
    """Start SGLang's output loop on this event loop now, without its signal handlers.

    The tokenizer manager starts the task that reads its detokenizer's outputs on the first
    request, on the caller's loop, and on the main thread also takes SIGTERM and SIGQUIT on
    that loop, which would replace the worker host's drain on SIGTERM. Its main-thread check
    is answered "no" for the call."""
    main_thread = threading.main_thread
    threading.main_thread = lambda: None  # type: ignore[assignment,return-value]
    try:
        tokenizer_manager.auto_create_handle_loop()
    finally:
        threading.main_thread = main_thread


def _card(engine: Any, served_name: str) -> ModelCard:
    server_args = engine.server_args
    tm = engine.tokenizer_manager
    model = tm.model_config
    model_dir = Path(server_args.model_path)
    page_size = server_args.page_size
    # What the scheduler sized its KV pool to, as Engine.get_server_info reports it (which
    # runs on SGLang's own loop, so it cannot be called from this one).
    max_tokens = engine._scheduler_init_result.scheduler_infos[0]["max_total_num_tokens"]
    cache_dtype = server_args.kv_cache_dtype
    itemsize = model.dtype.itemsize if cache_dtype == "auto" else (1 if "fp8" in cache_dtype else 2)
    if getattr(model, "kv_lora_rank", None):  # MLA: one latent per token and layer
        per_layer = model.kv_lora_rank + model.qk_rope_head_dim
    else:
        per_layer = 2 * model.num_key_value_heads * model.head_dim
    return ModelCard(
        name=served_name,
        model_path=str(model_dir),
        context_length=tm.context_len,
        block_size=page_size,
        kv_bytes_per_token=model.num_attention_layers * per_layer * itemsize,
        role="aggregated",
        backend="sglang",
        total_kv_blocks=max_tokens // page_size,
        max_num_seqs=server_args.max_running_requests or 0,
        eos_token_ids=model_eos_ids(model_dir),
        vocab_size=model.hf_text_config.vocab_size,
    )
