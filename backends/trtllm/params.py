"""Weir's requests as TensorRT-LLM's LLM API takes them, and its outputs and KV cache events
as Weir's.

Pure translation, importing no TensorRT-LLM, so it is tested on payloads recorded from its
source without the engine (which needs NVIDIA GPUs). `engine.py` builds `SamplingParams` and
`GuidedDecodingParams` from `sampling_kwargs` and passes the prompt's token ids to
`LLM.generate_async(..., streaming=True)`.

The frontend owns all text: the LLM runs with `skip_tokenizer_init`, so nothing is
detokenized and the end token is the adapter's to give. TensorRT-LLM takes one `end_id`;
the model's other eos ids become stop tokens, unless the request ignores eos.

Migration (`generated_token_ids`, tokens an earlier worker streamed): the continuation is
prefilled with the prompt and counts toward max_tokens, min_tokens and usage as DeepInfer
counts it. A structured-output request cannot be resumed mid-grammar and is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from backends.adapter import choice_regex, new_tokens
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import (
    FinishReason,
    GuidedSpec,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerRequest,
)

# CompletionOutput.finish_reason (executor/result.py) -> Weir's. "timeout" is TensorRT-LLM
# ending a request past its own deadline, "cancelled" an abort.
_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "timeout": "abort",
    "cancelled": "abort",
}

# TensorRT-LLM's cache levels (KVCacheStoredBlockData.cache_level) -> the media KvMirror
# knows: 0 is GPU memory, 1 the secondary (host) pool blocks are offloaded to.
_CACHE_LEVELS: dict[int, str] = {0: "GPU", 1: "CPU"}


def priority(request: WorkerRequest) -> float:
    """TensorRT-LLM's request priority, a float in [0, 1], higher first, 0.5 by default; Weir's
    is an integer, lower first, 0 by default. The map is monotonic and keeps 0 at 0.5."""
    p = request.priority
    return 0.5 - p / (2 * (1 + abs(p)))


def sampling_kwargs(request: WorkerRequest, eos_token_ids: Sequence[int]) -> dict[str, Any]:
    """`SamplingParams` fields for `request`; a `guided_decoding` value is the field map of
    `GuidedDecodingParams`. `eos_token_ids` are the model's (the card's)."""
    most, fewest = new_tokens(request, "TensorRT-LLM")
    if not eos_token_ids:
        raise EngineError("internal", "the model directory names no eos token; TensorRT-LLM needs an end_id")
    s = request.sampling
    if s.logit_bias:
        raise EngineError(
            "invalid_request",
            "the TensorRT-LLM adapter has no logit_bias: its SamplingParams take a whole-vocabulary "
            "embedding_bias tensor, not per-token biases",
        )
    end_id = eos_token_ids[0]
    stops = list(request.stop_token_ids)
    if not request.ignore_eos:
        stops += [t for t in eos_token_ids[1:] if t not in stops]
    kwargs: dict[str, Any] = {
        "end_id": end_id,
        "pad_id": end_id,
        "max_tokens": most,
        "min_tokens": fewest,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": max(s.top_k, 0),  # TensorRT-LLM's runtime: 0 is all logits, as Weir's 0 is
        "min_p": s.min_p,
        "seed": s.seed,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "stop_token_ids": stops or None,
        "ignore_eos": request.ignore_eos,
        "detokenize": False,
    }
    if request.logprobs is not None:
        # Asked for at least one, so the sampled token's logprob comes back even at 0.
        kwargs["logprobs"] = max(request.logprobs, 1)
    if request.guided is not None:
        kwargs["guided_decoding"] = guided_fields(request.guided)
    return kwargs


def guided_fields(guided: GuidedSpec) -> dict[str, Any]:
    """`GuidedDecodingParams` fields (sampling_params.py) for `guided`. It has json (a schema),
    regex, grammar (EBNF) and json_object; a choice becomes the regex matching exactly one
    of the strings."""
    value = guided.value
    if guided.kind == "json_object":
        return {"json_object": True}
    if guided.kind == "choice":
        return {"regex": choice_regex(value)}
    if not isinstance(value, str):
        raise EngineError("invalid_request", f"a {guided.kind} constraint needs a string value")
    field = {"json_schema": "json", "regex": "regex", "grammar": "grammar"}[guided.kind]
    return {field: value}


class Logprob(Protocol):
    """executor/result.py's `Logprob`: a token's log-probability and its vocabulary rank."""

    @property
    def logprob(self) -> float: ...

    @property
    def rank(self) -> int | None: ...


class CompletionOutput(Protocol):
    """The fields of TensorRT-LLM's CompletionOutput the adapter reads (cumulative)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def logprobs(self) -> Sequence[Mapping[int, Logprob] | float] | None: ...

    @property
    def finish_reason(self) -> str | None: ...


class RequestOutput(Protocol):
    @property
    def outputs(self) -> Sequence[CompletionOutput]: ...

    @property
    def cached_tokens(self) -> int: ...

    @property
    def finished(self) -> bool: ...


class DeltaMaker:
    """One request's streamed RequestOutputs as Weir's deltas.

    A streamed RequestOutput is the same object each time, its first CompletionOutput
    growing: `token_ids` and `logprobs` hold everything so far, so the maker slices off what
    it already sent. It reports the cached prompt tokens on the first delta and usage on the
    last."""

    def __init__(self, request: WorkerRequest) -> None:
        self.request = request
        self.migrated = len(request.generated_token_ids)
        self.sent = 0
        self._first = True

    def delta(self, out: RequestOutput) -> TokenDelta:
        completion = out.outputs[0]
        new = list(completion.token_ids[self.sent :])
        start, self.sent = self.sent, len(completion.token_ids)
        prompt_tokens = len(self.request.token_ids)
        cached = min(out.cached_tokens or 0, prompt_tokens)
        reason = _FINISH.get(completion.finish_reason or "", "stop") if out.finished else None
        logprobs = None
        if self.request.logprobs is not None:
            entries = list((completion.logprobs or [])[start : self.sent])
            logprobs = _logprobs(new, entries, self.request.logprobs)
        first, self._first = self._first, False
        return TokenDelta(
            token_ids=new,
            logprobs=logprobs,
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=self.migrated + self.sent,
                cached_tokens=cached,
            )
            if reason is not None
            else None,
            cached_tokens=cached if first else None,
        )


def _logprobs(
    token_ids: Sequence[int], entries: Sequence[Mapping[int, Logprob] | float], top: int
) -> list[TokenLogprob]:
    """TensorRT-LLM gives, per output token, either a map token id -> Logprob of the most
    likely tokens (the PyTorch backend) or the sampled token's logprob alone (a float). A map
    without the sampled token cannot give its logprob: that is an error, not a guess."""
    out: list[TokenLogprob] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        if not isinstance(entry, Mapping):
            out.append(TokenLogprob(token_id, float(entry), []))
            continue
        if token_id not in entry:
            raise EngineError("internal", f"TensorRT-LLM gave no logprob for the sampled token {token_id}")
        ranked = sorted(
            entry.items(), key=lambda item: (item[1].rank is None, item[1].rank, -item[1].logprob)
        )
        out.append(
            TokenLogprob(
                token_id,
                float(entry[token_id].logprob),
                [TopLogprob(tid, float(lp.logprob)) for tid, lp in ranked[:top]],
            )
        )
    return out


def kv_fields(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """TensorRT-LLM's KV cache events (`LLM.get_kv_cache_events`, serialized by
    `_utils.KVCacheEventSerializer`) as the field maps `KvMirror.apply` reads, in order.

    A "stored" event is a chain of blocks under `parent_hash`, each with its `tokens` (as
    {"token_id", "token_extra_id"} maps) and `cache_level`; it becomes one BlockStored per
    run of blocks on the same level. "removed" names block hashes, of whichever level holds
    them, so it becomes a BlockRemoved for each. "created" (the pool's sizes) and "updated"
    (a block's priority or level changing) say nothing about which prefixes are cached and
    are left out; a block offloaded to host memory stays mirrored where it was stored.
    Blocks whose tokens carry extra ids (multimodal or prompt-table tokens) cannot be keyed
    by Weir's hash and are dropped, and with them (KvMirror never sees their parent) the
    blocks chained below them."""
    out: list[dict[str, Any]] = []
    for event in events:
        data = event.get("data") or {}
        kind = data.get("type")
        if kind == "stored":
            out.extend(_stored(data))
        elif kind == "removed":
            hashes = list(data.get("block_hashes") or [])
            if hashes:
                out.extend(
                    {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
                    for medium in _CACHE_LEVELS.values()
                )
    return out


def _stored(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One "stored" event as BlockStored events: consecutive blocks of one level and size
    travel together, chained as TensorRT-LLM chained them."""
    events: list[dict[str, Any]] = []
    parent = data.get("parent_hash")
    for block in data.get("blocks") or []:
        tokens = block.get("tokens") or []
        medium = _CACHE_LEVELS.get(block.get("cache_level", 0))
        if medium is not None and not any(t.get("token_extra_id") for t in tokens):
            last = events[-1] if events else None
            if (
                last is not None
                and last["medium"] == medium
                and last["block_size"] == len(tokens)
                and last["block_hashes"][-1] == parent
            ):
                last["block_hashes"].append(block["block_hash"])
                last["token_ids"].extend(t["token_id"] for t in tokens)
            else:
                events.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": [block["block_hash"]],
                        "parent_block_hash": parent,
                        "token_ids": [t["token_id"] for t in tokens],
                        "block_size": len(tokens),
                        "medium": medium,
                    }
                )
        parent = block["block_hash"]
    return events
