"""Continuous batching, the vLLM v1 way: one token budget per step shared by decodes and
(chunked) prefills, running sequences first, then waiting ones.

Order is (priority, arrival): lower priority values go first, as in vLLM; with every request
at the default priority this is plain FCFS. `running` is kept sorted by that key, so the
sequence to preempt when blocks run out is always its last one, which has not been scheduled
yet in the current step. Preemption is by recompute: the victim's blocks are freed, it goes
back to waiting with its tokens, and the prefix cache usually gives most of its KV back.

Disaggregation: a prefill-only request finishes after its first token ("length") with its
prompt's blocks held under its request id (`held`), until `release` drops them. A decode
request whose prompt KV is still on its way from the prefill worker is added `arriving`: it
waits with the sequences whose KV a slow tier reads (`loading`, LOADING_KV), keeping its
place in the queue, until `arrive` hands over what came.

Speculative decoding (`num_speculative_tokens`): a decode step may carry draft tokens, from
the n-gram proposer (ngram.py) or from the model's MTP layer (the runner's, left in
`seq.draft` by the step before), which the step computes like a prompt chunk and samples at
every position. `postprocess` keeps the sampled tokens up to and including the first one that
differs from its draft: each was sampled from the sequence as it stood with the drafts before
it, so the output is what plain decoding would give (for a seeded request too, whose draws
are by output position). The KV written for rejected drafts lies past `num_computed_tokens`,
where the next step overwrites it. Guided requests are not drafted: their grammar would have
to advance through every draft.

Nothing here touches torch; the model runner reads each ScheduledChunk and `seq.block_table`.
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from backends.deepinfer.config import EngineConfig
from backends.deepinfer.kv_cache_manager import Held, KVCacheManager
from backends.deepinfer.ngram import NgramProposer
from backends.deepinfer.outputs import SampledToken, ScheduledChunk, SchedulerOutput, SeqOutput
from backends.deepinfer.sequence import Sequence, SequenceStatus
from kvbm.records import Payload
from kvbm.tiered import TieredStore
from orchestrator.runtime.protocol import LoadReport, WorkerRequest


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        tiers: TieredStore | None = None,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.max_model_len = max_model_len or config.max_model_len or None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_cache = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            tiers,
            sliding_window,
            config.kv_eviction,
        )
        self.waiting: list[tuple[int, int, Sequence]] = []  # heap of (priority, arrival, seq)
        self.running: list[Sequence] = []  # sorted by (priority, arrival)
        # Waiting sequences whose prefix a slow KV tier is reading; back in `waiting` when done.
        self.loading: list[Sequence] = []
        self._order: dict[str, tuple[int, int]] = {}  # request_id -> (priority, arrival)
        self.held: dict[str, Held] = {}  # transfer id (the prefill-only request's id) -> its blocks
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = 0
        self._waiting_tokens = 0  # sum of len(seq) over `waiting`, kept so load reports are cheap
        self.speculating = config.num_speculative_tokens > 0
        self.proposer = (
            NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
            if self.speculating and config.speculative_method == "ngram"
            else None
        )
        # The MTP layer drafts its second and later tokens one position further on each, into
        # KV slots the next step's chunk will cover: sampling chunks get them allocated ahead.
        self.lookahead = config.num_speculative_tokens - 1 if config.speculative_method == "mtp" else 0
        self.num_draft_tokens = 0  # draft tokens verified, ever
        self.num_accepted_tokens = 0  # of those, the ones the model agreed with

    # ------------------------------------------------------------------ requests

    def add(self, request: WorkerRequest, arriving: bool = False) -> Sequence:
        """Queue a request; ValueError (with a message for the client) if it can never run.
        `arriving`: its prompt KV is on its way (disaggregation); it runs after `arrive`."""
        self._validate(request)
        seq = Sequence(request)
        del seq.block_hashes[len(seq) // self.block_size :]  # only the prompt's full blocks
        self._arrivals += 1
        key = (request.priority, self._arrivals)
        self._order[seq.request_id] = key
        self._seqs[seq.request_id] = seq
        if arriving:
            seq.status, seq.arriving = SequenceStatus.LOADING_KV, True
            self.loading.append(seq)
        else:
            heapq.heappush(self.waiting, (*key, seq))
        self._waiting_tokens += len(seq)
        return seq

    def arrive(self, request_id: str, arrived: dict[int, Payload]) -> None:
        """An arriving sequence's KV is here (`arrived`: what came and checks out, possibly
        nothing): from the next step it queues at its place with those blocks as prefix
        hits. Unknown ids (aborted meanwhile) are a no-op."""
        seq = self._seqs.get(request_id)
        if seq is not None and seq.arriving:
            seq.arrived, seq.arriving = arrived, False

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is and free its blocks at once; None if unknown."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.LOADING_KV:
            self.loading.remove(seq)
            self._waiting_tokens -= len(seq)
        else:
            self.waiting = [entry for entry in self.waiting if entry[2] is not seq]
            heapq.heapify(self.waiting)
            self._waiting_tokens -= len(seq)
        self._finish(seq, "abort")
        return seq

    def release(self, transfer_id: str) -> None:
        """Drop the blocks held for a prefill-only request; unknown ids are a no-op."""
        held = self.held.pop(transfer_id, None)
        if held is not None:
            self.kv_cache.release(held)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading)

    def queued_prefill_tokens(self) -> int:
        """Tokens still to prefill: waiting sequences whole, running ones' unfinished prompts."""
        running = sum(n for s in self.running if (n := s.num_prompt_tokens - s.num_computed_tokens) > 0)
        return self._waiting_tokens + running

    def load(self) -> LoadReport:
        """The engine's load report; the worker host fills in the worker id and event id."""
        return LoadReport(
            worker_id="",
            active_requests=self.num_running,
            waiting_requests=self.num_waiting,
            active_blocks=self.kv_cache.num_active_blocks,
            total_blocks=self.kv_cache.num_blocks,
            queued_prefill_tokens=self.queued_prefill_tokens(),
        )

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        if self.loading:
            self._requeue_loaded()
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        # As vLLM: a step that had to preempt admits nobody new, or it would thrash.
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.loads = self.kv_cache.take_loads()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        running, chunks, block_size = self.running, out.chunks, self.block_size
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start, total = seq.num_computed_tokens, len(seq.token_ids)
            n = total - start if total - start < budget else budget
            # n == 1 is a decode step, or a longer chunk cut to the budget's last token, which
            # leaves no budget to draft with.
            draft = self._draft(seq, budget - n) if self.speculating and n == 1 else []
            sample = start + n == total
            slots = n + len(draft)
            if sample and self.lookahead:
                slots += self._lookahead(seq, start + slots)
            # Most decode steps fit in the last block's free slots: nothing to allocate.
            if start + slots > len(seq.block_table) * block_size:
                if not self._make_room(seq, slots, out):
                    break  # seq itself was preempted; everything after it already was
                self.kv_cache.allocate(seq, slots)
            chunks.append(ScheduledChunk(seq, start, n, sample, draft))
            budget -= n + len(draft)
            i += 1
        return budget

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for a decode step of `seq`: none past its max_tokens or the context
        limit (where the step's last sampled token may fall), or beyond the step's budget."""
        request = seq.request
        if request.guided is not None or len(seq.token_ids) <= seq.num_prompt_tokens:
            return []
        room = min(budget, request.max_tokens - seq.num_completion_tokens - 1)
        if self.max_model_len:
            room = min(room, self.max_model_len - len(seq.token_ids) - 1)
        if self.proposer is None:
            return seq.draft[: max(room, 0)]
        return self.proposer.propose(seq.token_ids, room)

    def _lookahead(self, seq: Sequence, end: int) -> int:
        """Slots past position `end` for the MTP layer's later drafts: none past the last
        position the request may compute (its last token's is never needed)."""
        last = seq.num_prompt_tokens + seq.request.max_tokens - 1
        if self.max_model_len:
            last = min(last, self.max_model_len - 1)
        return max(0, min(self.lookahead, last - end))

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt from the back of `running` until `seq` fits; False if `seq` itself went."""
        while not self.kv_cache.can_allocate(seq, num_tokens):
            victim = self.running.pop()
            self.kv_cache.deallocate(victim)
            victim.status = SequenceStatus.WAITING
            heapq.heappush(self.waiting, (*self._order[victim.request_id], victim))
            self._waiting_tokens += len(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _requeue_loaded(self) -> None:
        """Loading sequences whose read finished rejoin the queue at their original place."""
        still: list[Sequence] = []
        for seq in self.loading:
            if seq.fetch.running or seq.arriving:
                still.append(seq)
            else:
                seq.status = SequenceStatus.WAITING
                heapq.heappush(self.waiting, (*self._order[seq.request_id], seq))
        self.loading = still

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv_cache
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0][2]
            prefix = kv.match_prefix(seq)
            if prefix.waiting:
                # Its KV is on its way from a slow tier: the ones behind it go first meanwhile.
                heapq.heappop(self.waiting)
                seq.status = SequenceStatus.LOADING_KV
                self.loading.append(seq)
                continue
            start = prefix.num_tokens(self.block_size)
            n = len(seq) - start
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            sample = start + n == len(seq)
            slots = n + (self._lookahead(seq, len(seq)) if sample and self.lookahead else 0)
            if not kv.can_allocate(seq, slots, prefix):
                break  # strict order: nobody overtakes the head of the queue
            heapq.heappop(self.waiting)
            self._waiting_tokens -= len(seq)
            kv.allocate(seq, slots, prefix)
            seq.status = SequenceStatus.RUNNING
            insort(self.running, seq, key=self._key)
            out.chunks.append(ScheduledChunk(seq, start, n, sample))
            budget -= n

    def postprocess(self, out: SchedulerOutput, sampled: Seq[SampledToken]) -> list[SeqOutput]:
        """Apply a finished step: `sampled` holds one token per chunk with `sample=True`, in
        chunk order. Appends tokens, applies stop conditions, frees finished sequences."""
        results: list[SeqOutput] = []
        i = 0
        any_finished = False
        kv, block_size, running = self.kv_cache, self.block_size, SequenceStatus.RUNNING
        for c, chunk in enumerate(out.chunks):
            seq, draft = chunk.seq, chunk.draft
            rows = sampled[i : i + 1 + len(draft)] if chunk.sample else sampled[i:i]
            i += len(rows)
            if seq.status is not running:
                continue  # aborted while the step ran
            if out.drafts:
                seq.draft = out.drafts[c]
            reason: str | None = None
            new: list[SampledToken] = []
            kept = chunk.verified([t.token_id for t in rows]) if draft else len(rows)
            for token in rows[:kept]:
                new.append(token)
                seq.token_ids.append(token.token_id)
                reason = self._stop_reason(seq, token.token_id)
                if reason is not None:
                    break
            # The known tokens' KV, and each accepted draft token's (reaching past the prompt
            # only for a sampled chunk, whose tokens are appended first).
            computed = seq.num_computed_tokens + chunk.num_tokens + max(len(new) - 1, 0)
            if draft:
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += len(new) - 1
                seq.num_draft_tokens += len(draft)
                seq.num_accepted_tokens += len(new) - 1
            seq.num_computed_tokens = computed
            if computed >= (seq.num_registered_blocks + 1) * block_size:
                kv.cache_full_blocks(seq)  # a block filled up
            if kv.sliding_window is not None:
                kv.release_outside_window(seq)
            if not new:
                continue
            if reason is not None:
                self._finish(seq, reason)
                any_finished = True
            results.append(SeqOutput(seq, new, reason is not None))
        if any_finished:
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        return results

    # ------------------------------------------------------------------ decode stretches

    def decode_stretch(self) -> int:
        """How many of the next steps are one and the same decode step: every running sequence
        decodes a token, nobody waits to be admitted, and no step allocates a block, fills
        one or ends a sequence by its length. A simulator takes such a stretch at once
        (`advance`), since nothing in it changes but the tokens; 0 when the next step is any
        other. Stops on a token (EOS, stop ids) are the caller's to rule out: only it knows
        the tokens before they are sampled."""
        running = self.running
        if self.waiting or self.loading or not running or len(running) > self.max_num_batched_tokens:
            return 0
        block_size, limit = self.block_size, self.max_model_len
        steps = limit or 1 << 62
        for seq in running:
            length, computed = len(seq.token_ids), seq.num_computed_tokens
            if length - computed != 1 or length <= seq.num_prompt_tokens:
                return 0  # still prefilling
            # Step j (from 1) writes token computed + j - 1: it allocates past the table's
            # last slot, fills a block when computed + j completes one, and ends the sequence
            # when its generated count or the context length reaches its limit.
            steps = min(
                steps,
                len(seq.block_table) * block_size - computed,
                (seq.num_registered_blocks + 1) * block_size - computed - 1,
                seq.request.max_tokens - (length - seq.num_prompt_tokens) - 1,
            )
            if limit:
                steps = min(steps, limit - length - 1)
        return max(steps, 0)

    def advance(self, steps: int, tokens: Seq[Seq[int]]) -> None:
        """Take `steps` decode steps at once, `decode_stretch` having said they are alike:
        `tokens` holds each running sequence's `steps` new tokens, in `running` order."""
        for seq, new in zip(self.running, tokens, strict=True):
            seq.token_ids += new
            seq.num_computed_tokens += steps

    # ------------------------------------------------------------------ helpers

    def _key(self, seq: Sequence) -> tuple[int, int]:
        return self._order[seq.request_id]

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        request = seq.request
        generated = len(seq.token_ids) - seq.num_prompt_tokens
        if generated >= request.min_tokens and (
            token_id in request.stop_token_ids or (not request.ignore_eos and token_id in self.eos_token_ids)
        ):
            return "stop"
        limit = self.max_model_len
        if generated >= request.max_tokens or request.prefill_only or (limit and len(seq.token_ids) >= limit):
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        request = seq.request
        if request.prefill_only and reason == "length" and seq.num_completion_tokens < request.max_tokens:
            # A decode follows (the first token ended nothing): hold the prompt's KV for it.
            self.release(seq.request_id)  # a retry of the same request replaces its hold
            self.held[seq.request_id] = self.kv_cache.hold(seq)
        self.kv_cache.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.request_id]
        del self._order[seq.request_id]

    def _validate(self, request: WorkerRequest) -> None:
        if request.request_id in self._seqs:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not request.token_ids:
            raise ValueError("the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if request.min_tokens < 0 or request.min_tokens > request.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {request.min_tokens}")
        if len(request.generated_token_ids) >= request.max_tokens:
            raise ValueError(
                f"{len(request.generated_token_ids)} tokens were already generated; max_tokens is "
                f"{request.max_tokens}, so nothing is left to generate"
            )
        prompt = len(request.token_ids)
        resumed = prompt + len(request.generated_token_ids)
        if self.max_model_len and resumed >= self.max_model_len:
            raise ValueError(
                f"the prompt (with the tokens generated so far) has {resumed} tokens; "
                f"this model's limit is {self.max_model_len}"
            )
        extent = prompt + request.max_tokens
        if self.max_model_len:
            extent = min(extent, self.max_model_len)
        capacity = self.kv_cache.num_blocks * self.block_size
        if extent > capacity:
            # It could never run even alone: it would preempt itself forever.
            raise ValueError(
                f"prompt plus max_tokens is {extent} tokens; this worker's KV cache holds {capacity}"
            )
        if not self.enable_chunked_prefill and extent > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt plus max_tokens is {extent} tokens, over the {self.max_num_batched_tokens}-token "
                "step budget (chunked prefill is off)"
            )
