"""One step's flattened inputs and the paged-attention metadata that goes with them.

The model runner builds a `ForwardBatch` from a `SchedulerOutput` and hands it down the model
explicitly (no module-global context): every attention layer reads the same slot mapping and
block-table views. Tokens of all chunks are concatenated in chunk order ("flat" positions).

Attention splits the batch two ways:
- decode tokens (chunks of one token) are attended together, each over its own context padded
  to the longest one. Multi-head attention keeps those contexts in a contiguous per-layer
  workspace that lives across steps (`DecodePlan`): a sequence that keeps decoding only has
  its new k/v appended there instead of its whole context gathered from the paged cache
  again; MLA gathers its latent contexts from `decode_blocks` every step;
- prefill chunks (more than one token) are attended one by one, over the cached context before
  the chunk (`PrefillSpan.context_blocks`) plus the chunk itself.

Contexts are gathered a whole block at a time (block tables, not per-token slots): copying
`block_size` rows at once is about twice as fast as indexing every token.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from backends.deepinfer.kv_arrival import KVArrival
from backends.deepinfer.sequence import Sequence


@dataclass(slots=True)
class PrefillSpan:
    """A chunk of `end - begin` query tokens at flat positions [begin, end) whose sequence
    already has `context_len` tokens in the cache before the chunk."""

    begin: int
    end: int
    context_len: int
    # Block ids holding all context_len + (end - begin) tokens; None when context_len == 0
    # (then the chunk's own k/v are used directly, without a round trip through the cache).
    context_blocks: torch.Tensor | None

    @property
    def length(self) -> int:
        return self.context_len + self.end - self.begin


@dataclass(slots=True)
class DecodeRows:
    """What a set of layers' decode workspaces hold after the last step that wrote them: the
    sequence and context length of each row in use, how many rows the workspaces have, and
    their capacity in positions."""

    seqs: list[Sequence] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    num_rows: int = 0
    capacity: int = 0


class RowPlan(NamedTuple):
    order: list[int]  # row r holds this step's decode sequence order[r]
    move_from: list[int]  # rows past the new batch whose sequences continue ...
    move_to: list[int]  # ... in these rows, which sequences that left freed
    fresh: list[int]  # rows to rebuild from the paged cache
    kept: list[int]  # rows whose sequence continues (in place or moved), in order


def assign_rows(rows: DecodeRows, seqs: list[Sequence], lengths: Seq[int]) -> RowPlan:
    """Which workspace row each of this step's decode sequences takes, so that as little as
    possible moves: a sequence that continues (the same one, one token further on) keeps its
    row; the rows of those that left go to the new ones and, when the batch shrank, to the
    continuing sequences of the rows past its end. A sequence leaving costs one row's move at
    most, never a shift of every row after it. `rows` then describes this step, in row order."""
    previous = {id(s): (row, n) for row, (s, n) in enumerate(zip(rows.seqs, rows.lengths, strict=True))}
    size = len(seqs)
    order: list[int | None] = [None] * size
    outside: list[tuple[int, int]] = []  # (previous row, sequence) of continuing rows past the batch
    new: list[int] = []
    for i, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
        old = previous.get(id(seq))  # the previous list is alive, so ids are unambiguous
        if old is None or old[1] != n - 1:
            new.append(i)
        elif old[0] < size:
            order[old[0]] = i
        else:
            outside.append((old[0], i))
    holes = iter([row for row, i in enumerate(order) if i is None])
    plan = RowPlan([], [], [], [], [])
    for old_row, i in outside:
        row = next(holes)
        order[row] = i
        plan.move_from.append(old_row)
        plan.move_to.append(row)
    for i in new:
        row = next(holes)
        order[row] = i
        plan.fresh.append(row)
    plan.order.extend(i for i in order if i is not None)
    fresh = set(plan.fresh)
    plan.kept.extend(row for row in range(size) if row not in fresh)
    rows.seqs = [seqs[i] for i in plan.order]
    rows.lengths = [lengths[i] for i in plan.order]
    return plan


@dataclass(slots=True)
class DecodePlan:
    """How the decode tokens' contexts sit in the attention layers' decode workspaces
    (`[rows, Hk, capacity, d]`, row i for decode token i; rows past the batch are unused),
    decided once per step by the runner (`assign_rows`).

    A sequence that decoded in the previous step and is one token further on keeps its row's
    contents and gets only this step's k/v appended; any other row is rebuilt from the paged
    cache (after this step's k/v were stored there). A stable batch thus writes one entry per
    row and layer instead of gathering every context again, and a changed one rewrites only
    the rows that changed, in place (a workspace is reallocated only to grow)."""

    rows: int  # rows of the workspaces (at least the batch)
    capacity: int  # positions per workspace row (a multiple of the block size)
    length: int  # the longest context this step
    mask: torch.Tensor | None  # [B, 1, 1, length] bool, True on real context; None if all are `length`
    # The same for layers with a sliding window: True on the keys within it; None when no
    # layer has one or no context is longer than it (then `mask` serves them too).
    window_mask: torch.Tensor | None
    move_from: torch.Tensor | None  # [M] rows past the batch whose sequences continue ...
    move_to: torch.Tensor | None  # [M] ... in these rows (None when M = 0)
    fresh: torch.Tensor | None  # [F] rows rebuilt from the paged cache
    append_rows: torch.Tensor | None  # [K] rows of the continuing sequences, which take this step's k/v
    append_positions: torch.Tensor | None  # [K] where: each one's own position (context length - 1)


@dataclass(slots=True)
class StaticDecode:
    """A decode step in fixed shapes, as a CUDA graph replays it (decode_graphs.py): one token
    per row, every row attending over its whole workspace row under a mask. The workspaces
    already hold each row's context up to the token before this step's; the step appends its
    k/v at `positions`."""

    workspaces: list[tuple[torch.Tensor, torch.Tensor]]  # per cache layer: K and V, [B, Hk, capacity, d]
    rows: torch.Tensor  # [B] 0 .. B - 1
    positions: torch.Tensor  # [B] each row's new position (context length - 1)
    mask: torch.Tensor  # [B, 1, 1, capacity] bool, True on real context
    window_mask: torch.Tensor | None  # the same within the sliding window, for layers that have one


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) per token
    prefills: list[PrefillSpan]
    decode_index: torch.Tensor | None  # [B] flat positions of single-token chunks
    decode_blocks: torch.Tensor | None  # [B, N] block tables of the decode tokens, 0-padded
    decode_plan: DecodePlan | None
    sample_index: torch.Tensor  # [S] flat positions whose logits are returned
    # Onboarded blocks still being written, layer by layer; each cache layer waits for its own.
    kv_arrival: KVArrival | None = None
    static: StaticDecode | None = None  # a decode step in fixed shapes (then no prefills, no decode plan)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
