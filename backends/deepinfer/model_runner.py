"""The model runner: owns the device, the weights and the paged KV cache, and turns a
`SchedulerOutput` into logits. The only place where sequences become tensors."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from backends.deepinfer.config import EngineConfig
from backends.deepinfer.decode_graphs import DecodeGraphs
from backends.deepinfer.forward_batch import (
    DecodePlan,
    DecodeRows,
    ForwardBatch,
    PrefillSpan,
    RowPlan,
    assign_rows,
)
from backends.deepinfer.hf_config import HFConfig
from backends.deepinfer.host_memory import keep_large_buffers
from backends.deepinfer.kv_arrival import KVArrival
from backends.deepinfer.kv_cache import PagedKVCache
from backends.deepinfer.kv_cache_manager import NULL_BLOCK
from backends.deepinfer.layers import cpu_attention
from backends.deepinfer.layers.attention import Attention
from backends.deepinfer.layers.embed import LMHead
from backends.deepinfer.layers.linear import Linear
from backends.deepinfer.layers.mla import MLAttention
from backends.deepinfer.layers.moe import FusedExperts
from backends.deepinfer.loader import load_weights
from backends.deepinfer.models.base import CausalLM
from backends.deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM, MTPLayer
from backends.deepinfer.models.registry import build_model
from backends.deepinfer.outputs import ScheduledChunk, SchedulerOutput
from backends.deepinfer.sampler import argmax
from backends.deepinfer.sequence import Sequence

logger = logging.getLogger(__name__)

# Decode workspaces are sized for this many more blocks than the longest context, so a stable
# batch refills them once every this many blocks of decoding.
_WORKSPACE_HEADROOM_BLOCKS = 8

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Span(NamedTuple):
    """Tokens to run for one sequence: `tokens` at positions start, start + 1, ...; the last
    `samples` of them have their rows returned."""

    seq: Sequence
    start: int
    tokens: list[int]
    samples: int

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(slots=True)
class _StepLists:
    """A step's inputs as plain Python lists, before they become tensors: a step has many
    small spans, and one tensor per field is cheaper than one per span."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # begin, end, start, table
    decode_index: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_lengths: list[int] = field(default_factory=list)
    decode_seqs: list[Sequence] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)


# SDPA's kernels on a GPU, cuDNN's left out: it builds a plan for every new shape, and a decode
# step's contexts grow by a token each step. On an H200 (torch 2.11) its calls took 1.7 ms of CPU
# each, 60 % of a SmolLM2 decode step; flash and memory-efficient attention have no such cost.
_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


class ModelRunner:
    """Loads `config.model` and runs forward steps over the paged KV cache.

    Attributes for the rest of the engine: `device`, `dtype`, `hf_config`, `vocab_size`,
    `max_model_len`, `block_size`, `num_kv_blocks` (what the block manager may hand out:
    block ids are 0 .. num_kv_blocks - 1), `kv_bytes_per_token` (for the model card) and
    `kv_cache` (whole blocks as bytes, to offload and load back).

    Deterministic mode (`config.deterministic`) runs each chunk of a step as its own forward
    pass. Matmul kernels pick their blocking (and so their summation order) by the number of
    rows, and padded batched attention by the longest context, so a sequence's logits in a
    batch would depend on its neighbours in the last bits; one chunk per pass makes them depend
    only on the sequence itself (and on how its prefill was chunked, so the scheduler must
    chunk a prompt the same way whatever else is running). The cost is the batching: step time
    grows with the number of sequences instead of staying nearly flat. Measured on one CPU
    thread (CPU time, `benchmarks/model_runner.py`): 32 sequences of 128 prompt tokens -> 128
    tokens on the tiny Llama (hidden 256, 4 layers) took 4-6x longer (runs vary on a shared
    machine); SmolLM2-135M, 16 x 128 -> 16, 2.2-2.4x. On a GPU, where a batched step costs
    about what one sequence does, the factor approaches the batch size.
    """

    def __init__(self, config: EngineConfig) -> None:
        started = time.monotonic()
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_large_buffers()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_dir = Path(config.model)
        self.hf_config = HFConfig.load(self.model_dir)
        self.vocab_size: int = self.hf_config.vocab_size
        # Layers attend within their window, if they have one. When every layer has the same,
        # KV before it is released too (`sliding_window`); the others need the whole context.
        layer_windows = self.hf_config.layer_windows
        windows = set(layer_windows)
        self.sliding_window: int | None = next(iter(windows)) if len(windows) == 1 else None
        self._window = next((w for w in layer_windows if w is not None), None)  # the decode mask's
        self.max_model_len = self._max_model_len(windows)
        self.block_size = config.block_size
        mtp_layers = 1 if config.speculative_method == "mtp" else 0
        with torch.device(self.device):
            model = build_model(self.hf_config, self.max_model_len, mtp_layers)
        self.model: CausalLM = model.to(self.dtype).eval()
        load_weights(self.model, self.model_dir)
        for module in self.model.modules():
            if isinstance(module, Linear | LMHead):
                module.pack()  # on a CPU: oneDNN's matmuls (layers/linear.py)
        # The MTP layer drafts from the main model's hidden states, kept from each step until
        # `propose` has used them.
        self.mtp: MTPLayer | None = None
        if mtp_layers:
            assert isinstance(self.model, DeepseekV3ForCausalLM) and isinstance(self.model.mtp[0], MTPLayer)
            self.mtp = self.model.mtp[0]
        self._hidden: torch.Tensor | None = None
        self._cache_layers = [m for m in self.model.modules() if isinstance(m, Attention | MLAttention)]
        for i, layer in enumerate(self._cache_layers):
            layer.cache_layer = i
        if self._window is not None:
            if len(self._cache_layers) != len(layer_windows):
                raise ValueError(f"{self.hf_config.architecture}: no sliding window for its attention")
            for layer, window in zip(self._cache_layers, layer_windows, strict=True):
                if not isinstance(layer, Attention):
                    raise ValueError(f"{self.hf_config.architecture}: no sliding window for its attention")
                layer.sliding_window = window
        if cpu_attention.usable(self.device, self.dtype):
            for layer in self._cache_layers:  # time the CPU's attention paths now, not at the first prompt
                if isinstance(layer, Attention):
                    cpu_attention.faster_than_flash(layer.num_heads, layer.num_kv_heads, layer.head_dim)
        self.kv_bytes_per_token = sum(layer.cache_bytes_per_token(self.dtype) for layer in self._cache_layers)
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_from_memory()
        # One block more than the block manager hands out: where the padding rows of a
        # fixed-shape decode step write their K/V (decode_graphs.py), which nothing reads.
        for layer in self._cache_layers:
            layer.allocate_cache(self.num_kv_blocks + 1, self.block_size, self.dtype, self.device)
        self.kv_cache = PagedKVCache.from_layers(self._cache_layers, self.num_kv_blocks)
        # The decode workspaces' rows, of the main model's layers and of the MTP layer's (which
        # decodes other positions); reset after a failed step, so the next one refills.
        self._rows = DecodeRows()
        self._mtp_rows = DecodeRows()
        self.graphs = self._decode_graphs()
        logger.info(
            "loaded %s (%s) on %s/%s in %.1f s; KV cache %d blocks x %d tokens (%.2f GiB)",
            self.model_dir.name,
            self.hf_config.architecture,
            self.device,
            str(self.dtype).removeprefix("torch."),
            time.monotonic() - started,
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_blocks * self.block_size * self.kv_bytes_per_token / 2**30,
        )

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for decode steps, on a GPU, for models whose every step has the same
        shapes for the same batch: multi-head attention layers only (MLA gathers its contexts
        by length), no MoE (its experts' token groups vary), no MTP (its hidden states are kept
        between steps), not deterministic mode (one forward per chunk)."""
        config = self.config
        if self.device.type != "cuda" or config.enforce_eager or config.deterministic or self.mtp is not None:
            return None
        if not all(isinstance(layer, Attention) for layer in self._cache_layers):
            return None
        if any(isinstance(module, FusedExperts) for module in self.model.modules()):
            return None
        return self.decode_graphs(capture=True)

    def decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Fixed-shape decode steps over this runner's model and cache; `capture=False` runs
        them eagerly (on a CPU, for the tests)."""
        return DecodeGraphs(
            self.model,
            [layer for layer in self._cache_layers if isinstance(layer, Attention)],
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_batch=self.config.max_num_seqs,
            # No more than the cache itself: the workspaces hold a padded copy of part of it.
            max_workspace_bytes=self.num_kv_blocks * self.block_size * self.kv_bytes_per_token,
            scratch_slot=self.num_kv_blocks * self.block_size,
            window=self._window,
            kernels=self.attention_kernels,
            capture=capture,
        )

    def _max_model_len(self, windows: set[int | None]) -> int:
        limit = int(self.hf_config.get("max_position_embeddings", 2048))
        default = limit
        rope = self.hf_config.rope_parameters
        if rope["rope_type"] == "dynamic":
            limit = int(limit * float(rope["factor"]))  # what the scaling is for, when asked
        elif rope["rope_type"] == "longrope":
            # Its short factors, and transformers' logits, unless a longer context is asked for.
            default = int(rope["original_max_position_embeddings"])
        if len(windows - {None}) > 1:  # windows of several sizes: within the smallest all agree
            limit = min(limit, min(w for w in windows if w is not None))
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's limit {limit}")
        return self.config.max_model_len or min(default, limit)

    def _blocks_from_memory(self) -> int:
        by_memory = int(self.config.kv_cache_memory_gb * 2**30) // (self.kv_bytes_per_token * self.block_size)
        # More blocks than every running sequence at full length could use is wasted memory.
        useful = self.config.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
        blocks = min(by_memory, useful)
        if blocks < 1:
            raise ValueError(f"kv_cache_memory_gb={self.config.kv_cache_memory_gb} holds no KV block")
        return blocks

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step; return float32 logits `[S, vocab]` for the chunks with `sample=True`,
        in chunk order, `1 + len(chunk.draft)` rows each (S may be 0). Every chunk's tokens
        are written to the KV cache, and the step's onboarded blocks (`out.loads`) before any
        layer reads them."""
        arrival = None
        if out.loads:
            arrival = self.kv_cache.start_write(
                [b.block_id for b in out.loads], [b.payload for b in out.loads]
            )
        try:
            if self.config.deterministic:
                parts = [self._forward([c], arrival) for c in out.chunks] or [self._forward([], arrival)]
                logits, hidden = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            else:
                logits, hidden = self._forward(out.chunks, arrival)
            if self.mtp is not None:
                self._hidden = hidden
            return logits
        except BaseException:
            self._rows = DecodeRows()  # the workspaces may be half written
            if self.graphs is not None:
                self.graphs.reset()
            raise
        finally:
            if arrival is not None:
                # Every block is in before the step ends, whatever ran: the next schedule() may
                # hand these blocks to other sequences.
                arrival.wait_all()

    def _forward(
        self, chunks: list[ScheduledChunk], arrival: KVArrival | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks' sampled logits, and the final hidden states of all their tokens."""
        if not chunks:
            empty = torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
            return empty, empty
        spans = self._spans(chunks)
        lists = self._lists(spans)
        graphs = self.graphs
        # Every chunk one token, sampled, no KV arriving: a decode step a graph can replay.
        decode_only = arrival is None and len(lists.decode_index) == len(lists.sample_index) == len(spans)
        if graphs is not None and decode_only and graphs.fits(len(spans), max(lists.decode_lengths)):
            logits = graphs.run(
                lists.decode_seqs, lists.ids, lists.slots, lists.decode_tables, lists.decode_lengths
            )
            return logits, torch.empty(0, device=self.device)
        batch = self._tensors(lists, self._rows)
        batch.kv_arrival = arrival
        with self.attention_kernels():
            hidden = self.model(batch)
        return self.model.compute_logits(hidden[batch.sample_index]).float(), hidden

    def attention_kernels(self) -> AbstractContextManager[None]:
        return sdpa_kernel(_CUDA_SDPA) if self.device.type == "cuda" else nullcontext()

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, confirmed: Seq[Seq[int]]) -> list[list[int]]:
        """After `execute(out)` and sampling: the MTP layer's drafts for each chunk of `out`.

        `confirmed[i]` holds the tokens chunk i's step made part of its sequence: its sampled
        tokens up to the first that differs from its draft, [] for a chunk that samples
        nothing. The MTP layer runs at every position whose next token is now known (writing
        its own KV there) and drafts, for each sampling chunk, the token after its last
        confirmed one; then, up to `num_speculative_tokens`, each next one from the one before
        and its own hidden state, a position further on (vLLM's chaining of one MTP layer)
        into the slots the scheduler allocated ahead. [] for chunks that sample nothing."""
        hidden, self._hidden = self._hidden, None
        assert self.mtp is not None and hidden is not None
        spans: list[_Span] = []
        rows: list[int] = []
        begin = 0
        for chunk, tokens in zip(out.chunks, confirmed, strict=True):
            seq, start, known = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            # Position p is given token p + 1: the chunk's own, then what the step confirmed.
            after = list(tokens) if chunk.sample else seq.token_ids[known : known + 1]
            span = _Span(seq, start, seq.token_ids[start + 1 : known] + after, 1 if chunk.sample else 0)
            spans.append(span)
            rows.extend(range(begin, begin + len(span.tokens)))
            begin += chunk.num_tokens + len(chunk.draft)
        try:
            drafts, last = self._draft(spans, hidden.index_select(0, self._tensor(rows)))
            chains = [(span, [d]) for span, d in zip([s for s in spans if s.samples], drafts, strict=True)]
            for _ in range(self.config.num_speculative_tokens - 1):
                # Each chain's next draft, from its last one at the position after it, where
                # the scheduler allocated a slot (its lookahead stops at the request's end).
                steps: list[_Span] = []
                going: list[int] = []
                for i, (span, chain) in enumerate(chains):
                    at = span.end + len(chain) - 1
                    if at < self.max_model_len and at < len(span.seq.block_table) * self.block_size:
                        steps.append(_Span(span.seq, at, [chain[-1]], 1))
                        going.append(i)
                if not steps:
                    break
                index = self._tensor(going)
                drafts, states = self._draft(steps, last.index_select(0, index))
                last = last.index_copy(0, index, states)
                for i, token in zip(going, drafts, strict=True):
                    chains[i][1].append(token)
        except BaseException:
            self._mtp_rows = DecodeRows()
            raise
        it = iter(chain for _, chain in chains)
        return [next(it) if span.samples else [] for span in spans]

    def _draft(self, spans: list[_Span], previous_hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """The MTP layer over `spans`: its greedy token and output hidden state at each span's
        sampled row (one span at a time in deterministic mode)."""
        assert self.mtp is not None
        groups = [[span] for span in spans] if self.config.deterministic else [spans]
        tokens: list[int] = []
        states: list[torch.Tensor] = []
        at = 0
        for group in groups:
            n = sum(len(span.tokens) for span in group)
            batch = self._batch(group, self._mtp_rows)
            with self.attention_kernels():
                hidden = self.mtp(batch, previous_hidden[at : at + n])[batch.sample_index]
            tokens += argmax(self.mtp.compute_logits(hidden)).tolist()
            states.append(hidden)
            at += n
        return tokens, torch.cat(states)

    def prepare(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        """Flatten the chunks' tokens (and drafts) and build their cache slots and attention
        spans; the rows returned are each sampling chunk's last known token and its drafts."""
        return self._batch(self._spans(chunks), self._rows)

    def _spans(self, chunks: list[ScheduledChunk]) -> list[_Span]:
        spans: list[_Span] = []
        for chunk in chunks:
            seq, start, known, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens, chunk.end
            if chunk.num_tokens <= 0 or known > len(seq.token_ids) or end > self.max_model_len:
                raise ValueError(
                    f"request {seq.request_id}: bad chunk [{start}, {end}) for {len(seq.token_ids)} tokens"
                    f" (max_model_len {self.max_model_len})"
                )
            tokens = seq.token_ids[start:known] + chunk.draft
            spans.append(_Span(seq, start, tokens, 1 + len(chunk.draft) if chunk.sample else 0))
        return spans

    def _batch(self, spans: list[_Span], rows: DecodeRows) -> ForwardBatch:
        return self._tensors(self._lists(spans), rows)

    def _lists(self, spans: list[_Span]) -> _StepLists:
        bs = self.block_size
        lists = _StepLists()
        ids, positions, slots, sample_index = lists.ids, lists.positions, lists.slots, lists.sample_index
        for seq, start, tokens, samples in spans:
            end = start + len(tokens)
            table = seq.block_table[: -(-end // bs)]
            if len(table) * bs < end:
                raise ValueError(f"request {seq.request_id}: {len(seq.block_table)} blocks for {end} tokens")
            if self.sliding_window is not None:
                # Blocks that slid out of the window were released (NULL_BLOCK); any block reads
                # for them, since the window mask hides them.
                table = [0 if b == NULL_BLOCK else b for b in table]
            begin = len(ids)
            ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if end - start == 1:
                lists.decode_index.append(begin)
                lists.decode_tables.append(table)
                lists.decode_lengths.append(end)
                lists.decode_seqs.append(seq)
            else:  # a prompt chunk, or a decode step with its draft: attended like a prompt's
                lists.prefills.append((begin, len(ids), start, table))
            sample_index.extend(range(len(ids) - samples, len(ids)))
        return lists

    def _tensors(self, lists: _StepLists, rows: DecodeRows) -> ForwardBatch:
        batch = ForwardBatch(
            input_ids=self._tensor(lists.ids),
            positions=self._tensor(lists.positions),
            slot_mapping=self._tensor(lists.slots),
            prefills=[
                PrefillSpan(begin, end, start, self._tensor(table) if start else None)
                for begin, end, start, table in lists.prefills
            ],
            decode_index=None,
            decode_blocks=None,
            decode_plan=None,
            sample_index=self._tensor(lists.sample_index),
        )
        if lists.decode_index:
            width = max(len(t) for t in lists.decode_tables)
            rows_plan = assign_rows(rows, lists.decode_seqs, lists.decode_lengths)
            order = rows_plan.order  # the decode tokens in workspace row order
            tables = [lists.decode_tables[i] for i in order]
            padded = [t + [0] * (width - len(t)) for t in tables]  # block 0: masked out
            batch.decode_index = self._tensor([lists.decode_index[i] for i in order])
            batch.decode_blocks = self._tensor(padded)
            batch.decode_plan = self._decode_plan(rows_plan, rows, width)
        return batch

    def _decode_plan(self, plan: RowPlan, rows: DecodeRows, width: int) -> DecodePlan:
        """The step's workspace plan from its row assignment. The workspaces keep their rows
        while the batch fits them, so a batch that shrank and grows again reuses them; they
        are reallocated when it outgrows them, and when its longest context does (then with
        room for a few more blocks, and only as many rows as the batch has), keeping what the
        rows in use hold."""
        lengths = rows.lengths
        length = max(lengths)
        if length > rows.capacity:
            rows.capacity = (width + _WORKSPACE_HEADROOM_BLOCKS) * self.block_size
            rows.num_rows = 0  # reallocated anyway: the batch's rows, not the most it ever had
        rows.num_rows = max(rows.num_rows, len(lengths))
        lengths_t = self._tensor(lengths)
        mask = window_mask = None
        window = self._window
        if min(lengths) < length or (window is not None and length > window):
            at = torch.arange(length, device=self.device)[None, :]
            real = at < lengths_t[:, None]
            mask = real[:, None, None, :] if min(lengths) < length else None
            if window is not None and length > window:
                # The token at length - 1 sees the `window` keys up to itself.
                window_mask = (real & (at >= lengths_t[:, None] - window))[:, None, None, :]
        kept = self._tensor(plan.kept) if plan.kept else None
        return DecodePlan(
            rows=rows.num_rows,
            capacity=rows.capacity,
            length=length,
            mask=mask,
            window_mask=window_mask,
            move_from=self._tensor(plan.move_from) if plan.move_from else None,
            move_to=self._tensor(plan.move_to) if plan.move_to else None,
            fresh=self._tensor(plan.fresh) if plan.fresh else None,
            append_rows=kept,
            append_positions=None if kept is None else lengths_t.index_select(0, kept) - 1,
        )

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
