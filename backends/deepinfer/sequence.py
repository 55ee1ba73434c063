"""A request as the scheduler sees it: tokens, status, block table, counters. No torch."""

from __future__ import annotations

from enum import Enum, auto

from kvbm.records import Payload
from kvbm.tiered import Fetch
from orchestrator.runtime.protocol import WorkerRequest


class SequenceStatus(Enum):
    WAITING = auto()
    # Waiting for its prefix KV: a slow KV tier is reading it (kvbm.Fetch), or a prefill
    # worker's transfer is arriving (`arriving`).
    LOADING_KV = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request inside the engine.

    `num_computed_tokens` counts tokens whose KV is in the cache (prefix hits included);
    the model runs on `token_ids[num_computed_tokens:]`, a chunk at a time during prefill."""

    __slots__ = (
        "arrived",
        "arriving",
        "block_hashes",
        "block_table",
        "draft",
        "fetch",
        "finish_reason",
        "num_accepted_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_draft_tokens",
        "num_prompt_tokens",
        "num_registered_blocks",
        "request",
        "request_id",
        "status",
        "token_ids",
    )

    def __init__(self, request: WorkerRequest) -> None:
        self.request = request
        self.request_id = request.request_id
        # A migrated request resumes after the tokens it already generated elsewhere.
        self.token_ids: list[int] = [*request.token_ids, *request.generated_token_ids]
        self.num_prompt_tokens = len(request.token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # Sequence hashes of this sequence's full blocks, extended as tokens are generated.
        self.block_hashes: list[int] = list(request.block_hashes)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (for usage)
        self.num_draft_tokens = 0  # speculated tokens verified for it, and of those accepted
        self.num_accepted_tokens = 0
        self.draft: list[int] = []  # the MTP layer's draft for the next decode step
        # Leading entries of block_table already offered to the prefix cache (KVCacheManager).
        self.num_registered_blocks = 0
        self.finish_reason: str | None = None
        # Lower-tier blocks read for this sequence while it waits (kvbm.TieredStore.fetch_prefix).
        self.fetch = Fetch()
        # Disaggregation: the prompt blocks a prefill worker computed, by sequence hash, checked
        # against this engine's layout; taken as prefix hits when the sequence is admitted.
        # `arriving` while they are on their way (Scheduler.add, Scheduler.arrive).
        self.arrived: dict[int, Payload] = {}
        self.arriving = False

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]
