"""CUDA graphs for decode steps: a step's kernel launches replayed as one graph.

On a GPU a small model's decode step is bound by launching kernels, not by running them:
SmolLM2-135M at batch 32 on an H200 launched about 1,420 kernels for 2.7 ms of GPU time, and
a launch cost 7.9 µs eager against 0.85 µs replayed from a graph. vLLM and SGLang capture
decode steps as CUDA graphs per batch size; this does the same for DeepInfer.

A graph replays fixed shapes at fixed addresses, so:
- a replayed step reads its inputs from static buffers (token, position, cache slot and
  context length per row), padded to the captured batch size with copies of row 0 whose K/V
  go to a scratch slot nothing reads (a padding row computes other values than row 0 from the
  second layer on, so it must not share row 0's slot);
- it attends over a static decode workspace per layer, `[rows, Hk, capacity, d]`, whole: the
  mask hides what lies past each row's context. The rows carry over between steps as in the
  eager path (`forward_batch.assign_rows`): before a replay, rows that moved or are new are
  filled in eagerly, the new ones from the paged cache up to the token before this step's;
  the graph appends this step's k/v to every row;
- graphs are captured lazily, one per batch size for the workspace's capacity, which is a
  power of two: a batch whose contexts grow re-captures a few times.

`capture=False` runs the same fixed-shape step eagerly: on a CPU, where the tests check it
against the eager path.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from itertools import chain, count
from typing import Any

import torch

from backends.deepinfer.forward_batch import DecodeRows, ForwardBatch, StaticDecode, assign_rows
from backends.deepinfer.layers.attention import Attention, gather
from backends.deepinfer.models.base import CausalLM
from backends.deepinfer.sequence import Sequence

_MIN_CAPACITY = 256  # positions: below this a capacity step saves nothing worth a capture


def batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for (vLLM's): 1, 2, 4, then every multiple of 8,
    up to the first that holds `max_batch`."""
    sizes: list[int] = []
    for n in chain((1, 2, 4), count(8, 8)):
        sizes.append(n)
        if n >= max_batch:
            return sizes
    raise AssertionError("unreachable: count() is endless")


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        layers: list[Attention],
        *,
        block_size: int,
        max_model_len: int,
        max_batch: int,
        max_workspace_bytes: int,
        scratch_slot: int,
        window: int | None,
        kernels: Callable[[], AbstractContextManager[None]],
        capture: bool,
    ) -> None:
        """`layers`: the model's attention layers, in cache order; `max_workspace_bytes`: the
        most the workspaces may take (larger steps run eagerly); `scratch_slot`: a cache slot
        outside every block table; `window`: the sliding window of the layers that have one;
        `kernels`: the attention kernels' context (SDPA's choice)."""
        self.model = model
        self.layers = layers
        self.device = layers[0].k_cache.device
        self.block_size = block_size
        self.window = window
        self.kernels = kernels
        self.capture = capture
        self.scratch_slot = scratch_slot
        self.sizes = batch_sizes(max_batch)
        self.max_capacity = -(-max_model_len // block_size) * block_size
        self.max_workspace_bytes = max_workspace_bytes
        # Bytes of one position of one workspace row, K and V of every layer.
        self._position_bytes = sum(layer.cache_bytes_per_token(layer.k_cache.dtype) for layer in layers)
        # ids, positions, slots and context lengths, one column per row
        self._inputs = torch.zeros(4, self.sizes[-1], dtype=torch.long, device=self.device)
        self._workspaces: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rows = DecodeRows()  # what the workspaces' rows hold
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # size -> graph, its logits
        self._pool: Any = None  # the graphs' memory pool
        self.steps = 0  # decode steps run in fixed shapes

    def fits(self, batch: int, longest: int) -> bool:
        """Whether a decode step of `batch` sequences, the longest `longest` tokens, runs here:
        within the largest graph, and with workspaces no larger than allowed. (The workspaces
        copy the decoding sequences' KV, padded to a power of two: a long-context batch of a
        large model could take more memory than its cache.)"""
        if batch > self.sizes[-1]:
            return False
        rows, capacity = self._shape(self._size(batch), longest)
        return rows * capacity * self._position_bytes <= self.max_workspace_bytes

    def _size(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def _shape(self, size: int, longest: int) -> tuple[int, int]:
        """The workspaces' rows and capacity for a step of `size` rows: the current ones, or
        grown to hold it (rows at least doubling, so a batch that ramps up re-captures a few
        times, not at every size)."""
        rows, capacity = self._rows.num_rows, self._rows.capacity
        if size > rows:
            rows = max(size, min(2 * rows, self.sizes[-1]))
        needed = min(max(_MIN_CAPACITY, self.block_size, 1 << (longest - 1).bit_length()), self.max_capacity)
        return rows, max(capacity, needed)

    def reset(self) -> None:
        """After a failed step: the workspaces may be half written, so every row is rebuilt."""
        self._rows = DecodeRows(num_rows=self._rows.num_rows, capacity=self._rows.capacity)

    def run(
        self,
        seqs: list[Sequence],
        ids: list[int],
        slots: list[int],
        tables: list[list[int]],
        lengths: list[int],
    ) -> torch.Tensor:
        """Float32 logits `[B, vocab]` for a decode step (that `fits`): sequence i's token
        `ids[i]`, at position `lengths[i] - 1`, stored in slot `slots[i]`, its context in blocks
        `tables[i]`."""
        n = len(seqs)
        self.steps += 1
        size = self._size(n)
        rows, capacity = self._shape(size, max(lengths))
        if (rows, capacity) != (self._rows.num_rows, self._rows.capacity):
            self._grow(rows, capacity)
        plan = assign_rows(self._rows, seqs, lengths)
        if plan.move_from:
            self._move(plan.move_from, plan.move_to)
        order = plan.order  # row r runs sequence order[r]
        ids, slots = [ids[i] for i in order], [slots[i] for i in order]
        tables, lengths = [tables[i] for i in order], [lengths[i] for i in order]
        if plan.fresh:
            self._fill([tables[r] for r in plan.fresh], [lengths[r] - 1 for r in plan.fresh], plan.fresh)
        pad = size - n
        positions = [length - 1 for length in lengths]
        columns = [ids + ids[:1] * pad, positions + positions[:1] * pad]
        columns += [slots + [self.scratch_slot] * pad, lengths + lengths[:1] * pad]
        self._inputs[:, :size].copy_(torch.tensor(columns, dtype=torch.long))
        if self.capture:
            graph, logits = self._graphs.get(size) or self._capture(size)
            graph.replay()
        else:
            logits = self._step(size)
        rows_of = [0] * n  # sequence i's row
        for row, i in enumerate(order):
            rows_of[i] = row
        # In the callers' order, and a copy: the next replay overwrites the graph's output.
        return logits.index_select(0, torch.tensor(rows_of, device=self.device))

    # ------------------------------------------------------------------ workspaces

    def _grow(self, rows: int, capacity: int) -> None:
        """New workspaces of `rows` x `capacity`, holding what the old ones held; the graphs
        captured over the old ones go with them."""
        old, self._workspaces = self._workspaces, []
        for i, layer in enumerate(self.layers):
            shape = (rows, layer.num_kv_heads, capacity, layer.head_dim)
            pair = []
            for j, cache in enumerate((layer.k_cache, layer.v_cache)):
                workspace = cache.new_zeros(shape)  # zeros: a masked NaN still poisons the softmax
                if old:
                    previous = old[i][j]
                    workspace[: previous.shape[0], :, : previous.shape[2]] = previous
                pair.append(workspace)
            self._workspaces.append((pair[0], pair[1]))
        self._rows.num_rows, self._rows.capacity = rows, capacity
        self._graphs.clear()
        self._pool = None

    def _move(self, keep_from: list[int], keep_to: list[int]) -> None:
        source = torch.tensor(keep_from, device=self.device)
        target = torch.tensor(keep_to, device=self.device)
        for pair in self._workspaces:
            for workspace in pair:
                workspace.index_copy_(0, target, workspace.index_select(0, source))

    def _fill(self, tables: list[list[int]], known: list[int], rows: list[int]) -> None:
        """Rows `rows` from the paged cache: the first `known[i]` positions of blocks `tables[i]`."""
        length = max(known)
        if not length:
            return
        width = -(-length // self.block_size)
        blocks = torch.tensor([(t + [0] * width)[:width] for t in tables], device=self.device)
        index = torch.tensor(rows, device=self.device)
        for layer, pair in zip(self.layers, self._workspaces, strict=True):
            for cache, workspace in zip((layer.k_cache, layer.v_cache), pair, strict=True):
                # Past a row's own context this copies other blocks' entries: finite, and masked.
                workspace[index, :, :length] = gather(cache, blocks, length).transpose(1, 2)

    # ------------------------------------------------------------------ the step

    def _step(self, size: int) -> torch.Tensor:
        """The model over the first `size` rows of the static inputs, in fixed shapes."""
        ids, positions, slots, lengths = self._inputs[:, :size]
        at = torch.arange(self._rows.capacity, device=self.device)
        real = at < lengths[:, None]
        window_mask = None
        if self.window is not None:
            window_mask = (real & (at >= lengths[:, None] - self.window))[:, None, None, :]
        rows = torch.arange(size, device=self.device)
        static = StaticDecode(
            workspaces=[(k.narrow(0, 0, size), v.narrow(0, 0, size)) for k, v in self._workspaces],
            rows=rows,
            positions=lengths - 1,
            mask=real[:, None, None, :],
            window_mask=window_mask,
        )
        batch = ForwardBatch(
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            prefills=[],
            decode_index=None,
            decode_blocks=None,
            decode_plan=None,
            sample_index=rows,
            static=static,
        )
        with self.kernels():
            return self.model.compute_logits(self.model(batch)).float()

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # A first run outside the capture, on a side stream as torch's docs ask: it sets up what
        # kernels initialise lazily. It writes what the replay will write again.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(size)
        self._graphs[size] = (graph, logits)
        return graph, logits
