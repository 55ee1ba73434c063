"""The typed hand-offs between the engine's stages: scheduler -> runner -> postprocess."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from backends.deepinfer.sequence import Sequence
from kvbm.records import Payload
from orchestrator.runtime.protocol import Tier

# Where a loaded block comes from: a lower KV tier, or a prefill worker (disaggregation).
LoadSource = Tier | Literal["transfer"]


class BlockLoad(NamedTuple):
    """A prefix block onboarded into device block `block_id`, from a lower KV tier or from
    the KV a prefill worker computed."""

    block_id: int
    source: LoadSource
    payload: Payload  # empty in the mocker, which moves no bytes


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's share of a step: tokens [start, start + num_tokens) of `seq.token_ids`
    followed by `draft`, speculated tokens not in `seq.token_ids` yet (a decode step only).

    `sample` is true when the chunk reaches the end of the sequence's known tokens, so the
    step produces its next token (a finished prefill, or a decode step); a chunk with a draft
    is sampled at its last known token and at every draft token, to verify them."""

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool
    draft: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        """Where the chunk ends: its known tokens and its draft."""
        return self.start + self.num_tokens + len(self.draft)

    def verified(self, sampled: list[int]) -> int:
        """How many of the tokens sampled for this chunk (`1 + len(draft)` of them) its sequence
        keeps: up to and including the first that differs from its draft token (stop
        conditions aside)."""
        for j, token in enumerate(self.draft):
            if sampled[j] != token:
                return j + 1
        return len(self.draft) + 1


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting, blocks freed
    # Prefix blocks onboarded from lower KV tiers or a prefill worker: the runner writes them
    # into the device cache during the forward, each layer's before that layer reads them.
    loads: list[BlockLoad] = field(default_factory=list)
    # After the forward: each chunk's draft for its sequence's next step, from the model's MTP
    # layer (empty without one).
    drafts: list[list[int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens + len(c.draft) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def shape(self) -> tuple[int, bool]:
        """What the step's time depends on (`router.step_time`): the prompt tokens it computes
        (prompts, and preempted sequences' recompute) and whether it decodes a token for any
        sequence."""
        prefill_tokens, decoding = 0, False
        for chunk in self.chunks:
            seq = chunk.seq
            if chunk.num_tokens == 1 and len(seq.token_ids) > seq.num_prompt_tokens:
                decoding = True
                prefill_tokens += len(chunk.draft)  # verified like a prompt's tokens
            else:
                prefill_tokens += chunk.num_tokens
        return prefill_tokens, decoding


@dataclass(slots=True)
class SampledToken:
    """What the sampler produced for one chunk with `sample=True`."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class SeqOutput:
    """What one step did for one sequence, from `Scheduler.postprocess`: the tokens it gained
    (already appended to `seq.token_ids`) and whether it is now finished (`seq.finish_reason`)."""

    seq: Sequence
    new_tokens: list[SampledToken]
    finished: bool
