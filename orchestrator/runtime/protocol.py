"""Wire types shared by every plane.

All cross-process messages are msgspec structs (msgpack on the wire), never pickles or
untyped dicts. Field names follow the blueprint in docs/architecture.md; keep the structs
small and add a field only with a default, so older peers keep decoding newer messages.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

Role = Literal["aggregated", "prefill", "decode"]
Tier = Literal["device", "host", "disk", "remote"]
FinishReason = Literal["stop", "length", "abort", "error"]
ErrorCode = Literal[
    "invalid_request",  # the request itself is wrong: never retry
    "overloaded",  # the worker refused new work (draining, queue full): retry elsewhere
    "unavailable",  # the connection to the worker broke: retry elsewhere
    "cancelled",  # the caller cancelled
    "internal",  # the worker failed while serving it
]


# --------------------------------------------------------------------------- requests


class SamplingOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling knobs as OpenAI and vLLM name them. `top_k <= 0` and `top_p == 1` disable."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None


class GuidedSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A structured-output constraint. `value` is a JSON schema text, a regex, a list of
    choices or an EBNF grammar, by `kind`; `json_object` needs no value."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    value: str | list[str] | None = None


class KvTransfer(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Disaggregation: the prompt KV a prefill worker holds for one decode worker to pull.

    The last delta of a prefill-only request carries it; the frontend puts it in the decode
    request. The prefill worker keeps the blocks until they are pulled from its request plane
    (`kv_blocks`) or its hold expires, then frees them. What is pulled is kvbm records
    (header with sequence hash, layout and checksum, then the payload), so a decode worker
    loads only blocks of its own layout that arrived intact and recomputes the rest."""

    transfer_id: str
    source_worker: str = ""  # the prefill worker's instance id (its host fills it in)
    address: str = ""  # the prefill worker's request-plane address (its host fills it in)
    host_id: str = ""  # the prefill's machine: a decode worker on the same one may use shared memory
    block_hashes: list[int] = []  # the prompt's full blocks held, in prefix order
    layout: int = 0  # kvbm layout id of the records
    block_bytes: int = 0  # payload bytes of one block


class WorkerRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One generation request, token ids only: the frontend owns all text."""

    request_id: str
    token_ids: list[int]
    max_tokens: int
    sampling: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    # Sequence hashes of the prompt's full blocks at the worker's block size, computed once
    # by whoever tokenized (hash once, where tokens are produced). Empty means "not given".
    block_hashes: list[int] = []
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # None: no logprobs. 0: the sampled token's logprob only. k > 0: plus the top k.
    logprobs: int | None = None
    guided: GuidedSpec | None = None
    priority: int = 0
    cache_salt: str | None = None
    # Disaggregation. `prefill_only`: compute the prompt, sample its first token and finish
    # (finish_reason "length"), holding the prompt's KV for a decode worker: the last delta
    # carries `kv_transfer`. A request with `kv_transfer` (and the first token in
    # `generated_token_ids`) is that decode: its worker pulls the KV instead of computing it.
    prefill_only: bool = False
    kv_transfer: KvTransfer | None = None
    # Request migration: the tokens an earlier worker already streamed for this request, to be
    # continued, not repeated. The engine prefills token_ids + generated_token_ids and counts
    # them as output: toward max_tokens and min_tokens, in penalties and the grammar state,
    # in usage.completion_tokens, and as the positions that seeded sampling draws for.
    generated_token_ids: list[int] = []


class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[TopLogprob] = []


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Speculative decoding: draft tokens that became output, and draft tokens thrown away.
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0


class TokenDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One streamed step of a request. Deltas that are ready together travel together:
    `token_ids` may hold several tokens. The last delta carries `finish_reason` and `usage`."""

    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # The prompt tokens found in the prefix cache, on the FIRST delta of a request (None on
    # the others, and from engines that report it only in the final `usage`). A caller that
    # stops early (a stop string) still knows it without waiting for the last delta.
    cached_tokens: int | None = None
    # On the last delta of a prefill-only request: the KV its worker holds (None: none held,
    # e.g. a prompt shorter than one block; the decode worker then computes all of it).
    kv_transfer: KvTransfer | None = None


def merge_deltas(deltas: list[TokenDelta]) -> TokenDelta:
    """Consecutive deltas of one request as one: tokens and logprobs concatenated, the first
    one's `cached_tokens`, the last one's `finish_reason` and `usage`."""
    if len(deltas) == 1:
        return deltas[0]
    first, last = deltas[0], deltas[-1]
    has_logprobs = any(d.logprobs is not None for d in deltas)
    return TokenDelta(
        token_ids=[t for d in deltas for t in d.token_ids],
        logprobs=[lp for d in deltas for lp in d.logprobs or ()] if has_logprobs else None,
        finish_reason=last.finish_reason,
        usage=last.usage,
        cached_tokens=first.cached_tokens,
        kv_transfer=last.kv_transfer,
    )


class WorkerError(msgspec.Struct, kw_only=True):
    """A typed error frame. The request plane raises it on the caller's side as EngineError."""

    code: ErrorCode
    message: str
    retryable: bool = False


# --------------------------------------------------------------------------- KV events


class BlockStored(msgspec.Struct, tag="stored", kw_only=True, omit_defaults=True):
    """Blocks now cached, in prefix order; `parent_seq_hash` is the block before the first."""

    blocks: list[int]
    parent_seq_hash: int | None = None
    tier: Tier = "device"


class BlockRemoved(msgspec.Struct, tag="removed", kw_only=True, omit_defaults=True):
    seq_hashes: list[int]
    tier: Tier = "device"


class AllCleared(msgspec.Struct, tag="cleared", kw_only=True, omit_defaults=True):
    """Every block of one tier is gone, or of every tier when `tier` is None."""

    tier: Tier | None = None


KvEvent = BlockStored | BlockRemoved | AllCleared


class KvEventBatch(msgspec.Struct, kw_only=True):
    """What a worker publishes on `weir.<ns>.<model>.kv`.

    `event_id` numbers batches per worker, 1, 2, 3, ...: a router that sees a batch whose
    id is not last+1 has missed one and resyncs from the worker's snapshot."""

    worker_id: str
    event_id: int
    events: list[KvEvent]


class KvSnapshot(msgspec.Struct, kw_only=True):
    """All blocks a worker caches, as of `event_id` (the last batch it published)."""

    worker_id: str
    event_id: int
    blocks: dict[str, list[int]]  # tier -> seq hashes


# --------------------------------------------------------------------------- load


class StepCurves(msgspec.Struct, array_like=True):
    """How long the worker's engine steps take (`router.step_time.StepTime`): ms of a step's
    prefill part as a polynomial in its new tokens, of its decode part in the fraction of KV
    blocks in use, in ascending powers. `samples`: the steps fitted (0: not measured, the
    curve the worker simulates)."""

    prefill_ms: list[float]
    decode_ms: list[float]
    min_decode_ms: float = 1.0
    samples: int = 0


class LoadReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Published on `weir.<ns>.<model>.load` on change and at least every second."""

    worker_id: str
    active_requests: int = 0
    waiting_requests: int = 0
    active_blocks: int = 0
    total_blocks: int = 0
    queued_prefill_tokens: int = 0
    draining: bool = False
    # The id of the last KV event batch published: lets a router notice a lost final batch,
    # which no later batch would reveal. 0: not reported.
    kv_event_id: int = 0
    step_time: StepCurves | None = None  # None: the router's default curve


# --------------------------------------------------------------------------- discovery


class ModelCard(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a worker serves. `model_path` names a directory holding tokenizer.json and
    tokenizer_config.json (chat template) that the frontend reads, from its own disk or
    through the worker's `model_files` endpoint."""

    name: str
    model_path: str | None = None
    context_length: int = 4096
    block_size: int = 64
    kv_bytes_per_token: int = 0
    role: Role = "aggregated"
    backend: str = "mocker"
    total_kv_blocks: int = 0
    max_num_seqs: int = 0
    eos_token_ids: list[int] = []
    # Token ids lie in [0, vocab_size); 0: not known, only the u32 range is checked.
    vocab_size: int = 0
    # KV tiers below the device cache (kvbm): tier -> capacity in blocks (0: unbounded here,
    # as a shared remote store is). Empty: no tiers.
    kv_tiers: dict[str, int] = {}


class ModelFiles(msgspec.Struct, kw_only=True):
    """The tokenizer files of a worker's `card.model_path` (file name -> content), answered on
    the request plane's `model_files` endpoint for a frontend that cannot read the worker's
    disk: tokenizer.json, tokenizer_config.json, generation_config.json, config.json and
    chat_template.jinja, each when present. Never weights."""

    files: dict[str, bytes] = {}


class Instance(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One registered process. Workers carry their request-plane address and model card."""

    instance_id: str
    component: Literal["worker", "frontend", "router"]
    address: str = ""
    card: ModelCard | None = None
    draining: bool = False


# --------------------------------------------------------------------------- naming

_SUBJECT_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def subject(namespace: str, model: str, kind: Literal["kv", "load", "inflight", "routers"]) -> str:
    """The event-plane subject for a model's KV events, load reports, router in-flight load
    or router heartbeats.

    Model names hold '/' and '.', which NATS reads as token separators, so they are folded."""
    return f"weir.{_SUBJECT_UNSAFE.sub('_', namespace)}.{_SUBJECT_UNSAFE.sub('_', model)}.{kind}"
