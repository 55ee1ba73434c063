"""Weir's requests as vLLM takes them, and vLLM's outputs as Weir's deltas.

Pure translation, importing no vLLM, so it is tested on payloads recorded from vLLM 0.32
without the engine. `worker.py` builds vLLM's `SamplingParams` from `sampling_kwargs` and its
`TokensPrompt` from `prompt`.

The frontend owns all text: vLLM gets token ids, detokenizes nothing and stops only on token
ids (the card's eos ids, which vLLM reads from the same generation_config.json, and the
request's `stop_token_ids`); stop strings are the frontend's.

Migration (`generated_token_ids`, tokens an earlier worker streamed): the continuation is
prefilled with the prompt and counts toward max_tokens, min_tokens and usage as DeepInfer
counts it. vLLM's penalties and seeded draws count only what it generates itself, so a
penalised or seeded continuation may differ from an unbroken run; greedy ones do not. A
structured-output request cannot be resumed mid-grammar and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from backends.adapter import new_tokens, prompt_tokens
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import (
    FinishReason,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerRequest,
)

# vLLM's CompletionOutput.finish_reason -> Weir's. "repetition" (its repetition detector)
# ends the text as a stop would.
_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "error": "error",
    "repetition": "stop",
}


def prompt(request: WorkerRequest) -> dict[str, Any]:
    """vLLM's TokensPrompt: the prompt, then any tokens an earlier worker generated."""
    out: dict[str, Any] = {"prompt_token_ids": prompt_tokens(request)}
    if request.cache_salt:
        out["cache_salt"] = request.cache_salt
    return out


def sampling_kwargs(request: WorkerRequest) -> dict[str, Any]:
    """vLLM SamplingParams fields for `request` (output as deltas, token ids only)."""
    most, fewest = new_tokens(request, "vLLM")
    s = request.sampling
    kwargs: dict[str, Any] = {
        "max_tokens": most,
        "min_tokens": fewest,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": max(s.top_k, 0),  # vLLM 0.32: 0 (or -1) is off, as Weir's 0 is
        "min_p": s.min_p,
        "seed": s.seed,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "stop_token_ids": list(request.stop_token_ids),
        "ignore_eos": request.ignore_eos,
        "logprobs": request.logprobs,
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if s.logit_bias:
        kwargs["logit_bias"] = dict(s.logit_bias)
    if request.guided is not None:
        kwargs["structured_outputs"] = structured_outputs_kwargs(request)
    return kwargs


def structured_outputs_kwargs(request: WorkerRequest) -> dict[str, Any]:
    """vLLM StructuredOutputsParams fields for the request's `guided` constraint."""
    guided = request.guided
    assert guided is not None
    value = guided.value
    if guided.kind == "json_object":
        return {"json_object": True}
    if guided.kind == "choice":
        if not isinstance(value, list):
            raise EngineError("invalid_request", "a choice constraint needs a list of strings")
        return {"choice": list(value)}
    if not isinstance(value, str):
        raise EngineError("invalid_request", f"a {guided.kind} constraint needs a string value")
    field = {"json_schema": "json", "regex": "regex", "grammar": "grammar"}[guided.kind]
    return {field: value}


class LogprobEntry(Protocol):
    """vLLM's `Logprob`: one token's log-probability and its rank in the distribution."""

    logprob: float
    rank: int | None


class CompletionOutput(Protocol):
    token_ids: Sequence[int]
    logprobs: Sequence[Mapping[int, LogprobEntry]] | None
    finish_reason: str | None


class RequestOutput(Protocol):
    """The fields of vLLM's RequestOutput the adapter reads (output_kind DELTA)."""

    outputs: Sequence[CompletionOutput]
    num_cached_tokens: int | None
    finished: bool


class DeltaMaker:
    """One request's vLLM outputs as Weir's deltas: counts what was generated, reports the
    cached prompt tokens on the first delta and usage on the last."""

    def __init__(self, request: WorkerRequest) -> None:
        self.request = request
        self.completion_tokens = len(request.generated_token_ids)
        self._first = True

    def delta(self, out: RequestOutput) -> TokenDelta:
        completion = out.outputs[0]
        token_ids = list(completion.token_ids)
        self.completion_tokens += len(token_ids)
        prompt_tokens = len(self.request.token_ids)
        cached = min(out.num_cached_tokens or 0, prompt_tokens)
        reason = _FINISH.get(completion.finish_reason or "", "stop") if out.finished else None
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = _logprobs(token_ids, completion.logprobs or (), self.request.logprobs)
        first, self._first = self._first, False
        return TokenDelta(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=self.completion_tokens,
                cached_tokens=cached,
            )
            if reason is not None
            else None,
            cached_tokens=cached if first else None,
        )


def _logprobs(
    token_ids: Sequence[int], entries: Sequence[Mapping[int, LogprobEntry]], top: int
) -> list[TokenLogprob]:
    """vLLM gives, per token, a map holding the sampled token and the `top` most likely (the
    sampled one first, so it is there even when it ranks below them); Weir's TokenLogprob is
    the sampled token's logprob and the top `top` by rank."""
    out: list[TokenLogprob] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        ranked = sorted(
            ((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None),
        )
        out.append(
            TokenLogprob(
                token_id,
                entry[token_id].logprob,
                [TopLogprob(tid, logprob) for rank, tid, logprob in ranked[:top]],
            )
        )
    return out
