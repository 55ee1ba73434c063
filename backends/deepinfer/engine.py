"""The engine loop: `step()` is schedule -> run (forward, grammar mask, sample) -> postprocess.

`Engine` is synchronous and single-threaded in spirit; `AsyncEngine` drives it from a worker
thread. The scheduler's state is guarded by `lock`, held only while scheduling and
postprocessing, never during the forward pass, so `add`, `abort` and KV-event reads from
another thread wait at most for bookkeeping, not for the model.

An aborted request may be part of the step in flight. Its blocks are freed at once (the
forward still writes them, but nothing can reuse them before the next `schedule()`), while
its grammar matcher is released only after the step, because the sampling phase may be
using it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Protocol

import torch
from tokenizers import Tokenizer

from backends.deepinfer import metrics, transfers
from backends.deepinfer.config import EngineConfig
from backends.deepinfer.guided import Grammar, GuidedDecoding
from backends.deepinfer.kv_cache import PagedKVCache
from backends.deepinfer.kv_tiers import build_tiers, kv_layout_id
from backends.deepinfer.outputs import SampledToken, SchedulerOutput, SeqOutput
from backends.deepinfer.sampler import Sampler, sample_rows, validate_request
from backends.deepinfer.scheduler import Scheduler
from backends.deepinfer.sequence import Sequence
from kvbm.records import Payload
from orchestrator.runtime.model_files import eos_token_ids
from orchestrator.runtime.protocol import KvTransfer, WorkerRequest
from router.step_time import StepTimeFit


class Runner(Protocol):
    """What the engine needs from `model_runner.ModelRunner` (the only owner of the device)."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    kv_bytes_per_token: int
    sliding_window: int | None  # the attention window of every layer, if the model has one
    kv_cache: PagedKVCache  # used with KV tiers and disaggregation

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """float32 logits, `1 + len(chunk.draft)` rows per chunk with `sample=True`, in chunk
        order; `out.loads` written into the cache before any layer reads them."""
        ...

    def propose(self, out: SchedulerOutput, confirmed: Seq[Seq[int]]) -> list[list[int]]:
        """The MTP layer's draft per chunk after `execute(out)` (speculative method mtp only)."""
        ...


class Engine:
    def __init__(self, config: EngineConfig, runner: Runner | None = None) -> None:
        if runner is None:
            from backends.deepinfer.model_runner import ModelRunner

            runner = ModelRunner(config)
        self.config = config
        self.runner = runner
        self.model_dir = Path(config.model)
        self.name = config.served_model_name or self.model_dir.name
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = eos_token_ids(
            self.model_dir, Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        )
        self.max_model_len = self.runner.max_model_len
        self.tiers = build_tiers(config, self.runner.kv_cache) if config.host_cache_gb else None
        self.layout = kv_layout_id(config, self.runner.kv_cache)
        self.scheduler = Scheduler(
            config,
            self.runner.num_kv_blocks,
            self.eos_token_ids,
            self.max_model_len,
            self.tiers,
            self.runner.sliding_window,
        )
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, config.seed, config.deterministic)
        self.lock = threading.Lock()
        self._guided: GuidedDecoding | None = None  # built on first use: a 49k vocab takes ~0.2 s
        self._guided_init = threading.Lock()
        self._in_flight: set[str] = set()  # request ids in the step being run
        self._release_after_step: list[str] = []
        self.num_preemptions = 0  # sequences sent back to waiting for lack of blocks, ever
        self.last_step_tokens = 0  # tokens the last step ran (0: nothing could be scheduled)
        # The forward's time per step shape, reported to routers (LoadReport.step_time).
        self.step_fit = StepTimeFit()
        metrics.ENGINES.add(self)

    @property
    def guided(self) -> GuidedDecoding:
        with self._guided_init:
            if self._guided is None:
                self._guided = GuidedDecoding.from_model_dir(
                    self.model_dir, self.vocab_size, self.eos_token_ids
                )
            return self._guided

    # ------------------------------------------------------------------ requests

    def compile_grammar(self, request: WorkerRequest) -> Grammar | None:
        """Compile a request's constraint (slow the first time; thread-safe, so it can run off
        the engine thread). ValueError for a bad spec."""
        return None if request.guided is None else self.guided.compile(request.guided)

    def add(
        self,
        request: WorkerRequest,
        grammar: Grammar | None = None,
        arriving: bool = False,
    ) -> Sequence:
        """Queue a request; ValueError with a client-facing message if it is invalid.
        `arriving`: its prompt KV is on its way from a prefill worker (`arrive`)."""
        validate_request(request, self.vocab_size)
        if request.guided is not None and grammar is None:
            grammar = self.compile_grammar(request)
        with self.lock:
            seq = self.scheduler.add(request, arriving)
            if grammar is not None:
                try:  # a migrated request's grammar resumes after the tokens it generated
                    self.guided.add(seq.request_id, grammar, request.generated_token_ids)
                except ValueError:
                    self.scheduler.abort(seq.request_id)
                    raise
        return seq

    def arrive(self, request_id: str, arrived: dict[int, Payload]) -> None:
        """An arriving request's prompt blocks (`check_arrived`): it runs from the next step."""
        with self.lock:
            self.scheduler.arrive(request_id, arrived)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request and free its blocks now; None if it is unknown or already finished."""
        with self.lock:
            seq = self.scheduler.abort(request_id)
            if seq is not None:
                if request_id in self._in_flight:
                    self._release_after_step.append(request_id)
                else:
                    self._release(request_id)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ disaggregation

    def transfer(self, request_id: str) -> KvTransfer | None:
        """What a finished prefill-only request holds, for its last delta; None if nothing."""
        with self.lock:
            held = self.scheduler.held.get(request_id)
        return transfers.describe(request_id, held, self.layout, self.runner.kv_cache.block_bytes)

    def read_transfer(self, transfer_id: str) -> list[bytes] | None:
        """The held blocks as records. The blocks are referenced once more while their bytes
        are copied, so a release (or the hold's expiry) meanwhile cannot hand them to another
        sequence whose writes would then be sent under these hashes."""
        kv = self.scheduler.kv_cache
        with self.lock:
            held = self.scheduler.held.get(transfer_id)
            if held is None or not held.blocks:
                return None
            kv.retain(held)
        try:
            payloads = self.runner.kv_cache.read_blocks([block_id for block_id, _ in held.blocks])
        finally:
            with self.lock:
                kv.release(held)
        return transfers.to_records(held.blocks, payloads, self.layout)

    def release_transfer(self, transfer_id: str) -> None:
        with self.lock:
            self.scheduler.release(transfer_id)

    def check_arrived(self, transfer: KvTransfer, arrived_kv: Seq[bytes | memoryview]) -> dict[int, Payload]:
        """The prompt blocks of `arrived_kv` this engine can load (`transfers.arrived_blocks`)."""
        return transfers.arrived_blocks(transfer, arrived_kv, self.layout, self.runner.kv_cache.block_bytes)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[SeqOutput]:
        """One forward over the scheduled batch. Returns the sequences that gained a token
        (finished ones carry `finish_reason`); an empty list when there was nothing to run."""
        with self.lock:
            out = self.scheduler.schedule()
            self.num_preemptions += len(out.preempted)
            self.last_step_tokens = out.num_batched_tokens
            self._in_flight = {c.seq.request_id for c in out.chunks}
            kv_usage = self.scheduler.kv_cache.usage
        if out.is_empty:
            return []
        started = time.perf_counter()
        sampled = self.run(out)
        ms = (time.perf_counter() - started) * 1e3
        with self.lock:
            self.step_fit.observe(*out.shape(), kv_usage, ms)
            return self.postprocess(out, sampled)

    def run(self, out: SchedulerOutput) -> list[SampledToken]:
        """Forward (onboarded KV in layer by layer), grammar mask, sampling for the chunks that
        sample; then, with an MTP layer, its drafts for the next step (`out.drafts`)."""
        logits = self.runner.execute(out)
        chunks = [c for c in out.chunks if c.sample]
        sampled: list[SampledToken] = []
        if chunks:
            if self._guided is not None:  # guided requests are never drafted: one row each
                ids = [c.seq.request_id for c in chunks for _ in range(1 + len(c.draft))]
                self._guided.apply_mask(logits, ids)
            sampled = self.sampler(logits, [row for c in chunks for row in sample_rows(c)])
        if self.config.speculative_method == "mtp" and self.config.num_speculative_tokens:
            out.drafts = self.runner.propose(out, self._confirmed(out, sampled))
        return sampled

    @staticmethod
    def _confirmed(out: SchedulerOutput, sampled: list[SampledToken]) -> list[list[int]]:
        """Each chunk's sampled tokens that its sequence keeps (ScheduledChunk.verified)."""
        confirmed: list[list[int]] = []
        i = 0
        for chunk in out.chunks:
            if not chunk.sample:
                confirmed.append([])
                continue
            ids = [t.token_id for t in sampled[i : i + 1 + len(chunk.draft)]]
            i += len(ids)
            confirmed.append(ids[: chunk.verified(ids)])
        return confirmed

    def postprocess(self, out: SchedulerOutput, sampled: list[SampledToken]) -> list[SeqOutput]:
        outputs = self.scheduler.postprocess(out, sampled)
        if self.tiers is not None:
            self._offload()
        if self._guided is not None:
            self._advance_grammars(outputs)
        for o in outputs:
            if o.finished:
                self._release(o.seq.request_id)
        for request_id in self._release_after_step:
            self._release(request_id)
        self._release_after_step.clear()
        self._in_flight = set()
        return outputs

    def _offload(self) -> None:
        """Write the blocks this step completed through to the tiers, every step (the tiers
        copy this step's slow-tier loads up to host memory then). Under the lock with the rest
        of postprocess: nothing can reuse those blocks before the next schedule()."""
        assert self.tiers is not None
        block_of = {seq_hash: block_id for block_id, seq_hash in self.scheduler.kv_cache.take_saves()}
        cache = self.runner.kv_cache
        self.tiers.offload_into(
            list(block_of), lambda hashes, slots: cache.read_blocks_into([block_of[h] for h in hashes], slots)
        )

    def _advance_grammars(self, outputs: list[SeqOutput]) -> None:
        guided = self.guided
        for o in outputs:
            rid = o.seq.request_id
            if not guided.is_guided(rid):
                continue
            accepted = guided.accept(rid, o.new_tokens[-1].token_id)
            if not o.finished and (not accepted or guided.is_terminated(rid)):
                # The grammar ended on a stop token the scheduler let pass (ignore_eos, or
                # before min_tokens), or rejected a token: finish the request here.
                self.scheduler.abort(rid)
                o.seq.finish_reason = "stop" if accepted else "error"
                o.finished = True

    def _release(self, request_id: str) -> None:
        if self._guided is not None:
            self._guided.release(request_id)

    # ------------------------------------------------------------------ facts for the worker

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.runner.kv_bytes_per_token)
