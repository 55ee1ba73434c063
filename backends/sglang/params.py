"""Weir's requests as SGLang takes them, and SGLang's outputs and KV events as Weir's.

Pure translation, importing no SGLang, so it is tested on payloads recorded from SGLang
0.5.23's source without the engine (which targets GPUs). `engine.py` passes `generate_kwargs`
to `sglang.Engine.async_generate` and feeds each streamed output dict to a `DeltaMaker`.

The frontend owns all text: SGLang gets token ids and stops only on token ids (the model's
eos ids, which SGLang reads from the same model directory, and the request's
`stop_token_ids`); stop strings are the frontend's. SGLang still loads its tokenizer
(`skip_tokenizer_init` stays off) because it refuses `min_new_tokens` without one.

Migration (`generated_token_ids`, tokens an earlier worker streamed): the continuation is
prefilled with the prompt and counts toward max_tokens, min_tokens and usage as DeepInfer
counts it. SGLang's penalties and seeded draws count only what it generates itself, so a
penalised or seeded continuation may differ from an unbroken run; greedy ones do not. A
structured-output request cannot be resumed mid-grammar and is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from backends.adapter import choice_regex, new_tokens, prompt_tokens
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

# SGLang's finish_reason["type"] (schedule_batch.py, FINISH_*.to_json) -> Weir's.
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}

# SGLang's "top_k off" (sampling_params.py: "-1 (disable)"); 0 is rejected there.
TOP_K_OFF = -1


def generate_kwargs(request: WorkerRequest) -> dict[str, Any]:
    """The keyword arguments of `Engine.async_generate` for `request` (but `stream`)."""
    kwargs: dict[str, Any] = {
        "input_ids": prompt_tokens(request),
        "sampling_params": sampling_params(request),
        "rid": request.request_id,
        "priority": request.priority,
    }
    if request.logprobs is not None:
        kwargs["return_logprob"] = True
        kwargs["top_logprobs_num"] = request.logprobs
    if request.cache_salt:
        kwargs["cache_salt"] = request.cache_salt
    return kwargs


def sampling_params(request: WorkerRequest) -> dict[str, Any]:
    """SGLang's `sampling_params` dict for `request` (docs/basic_usage/sampling_params.mdx)."""
    most, fewest = new_tokens(request, "SGLang")
    s = request.sampling
    params: dict[str, Any] = {
        "max_new_tokens": most,
        "min_new_tokens": fewest,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else TOP_K_OFF,
        "min_p": s.min_p,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "ignore_eos": request.ignore_eos,
        "skip_special_tokens": False,
    }
    if request.stop_token_ids:
        params["stop_token_ids"] = list(request.stop_token_ids)
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    if s.logit_bias:
        # SGLang's logit_bias is keyed by the token id as a string, as OpenAI's is.
        params["logit_bias"] = {str(token): bias for token, bias in s.logit_bias.items()}
    if request.guided is not None:
        params.update(guided_fields(request.guided))
    return params


def guided_fields(guided: GuidedSpec) -> dict[str, str]:
    """SGLang's constraint field for `guided`: json_schema, regex or ebnf.

    json_object becomes the schema `{"type": "object"}`, as SGLang's own OpenAI server maps
    response_format json_object (serving_completions.py). SGLang has no choice constraint;
    a choice becomes the regex matching exactly one of the strings."""
    value = guided.value
    if guided.kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if guided.kind == "choice":
        return {"regex": choice_regex(value)}
    if not isinstance(value, str):
        raise EngineError("invalid_request", f"a {guided.kind} constraint needs a string value")
    field = {"json_schema": "json_schema", "regex": "regex", "grammar": "ebnf"}[guided.kind]
    return {field: value}


def abort_error(finish_reason: Mapping[str, Any]) -> EngineError | None:
    """The error an SGLang abort stands for, or None for a plain abort (the request was
    cancelled or the engine shut down). SGLang ends a streamed request it rejects after
    admission with an abort carrying an HTTP status (tokenizer_manager.py,
    `_handle_abort_finish_reason`): 400 is the request's fault, 503 a full queue
    (--max-queued-requests), anything else SGLang's."""
    if finish_reason.get("type") != "abort":
        return None
    status = finish_reason.get("status_code")
    if status is None:
        return None
    message = str(finish_reason.get("message") or "aborted")
    if status == 400:
        return EngineError("invalid_request", message)
    if status == 503:
        return EngineError("overloaded", message, retryable=True)
    return EngineError("internal", f"SGLang aborted the request ({status}): {message}")


class DeltaMaker:
    """One request's SGLang outputs as Weir's deltas.

    SGLang streams cumulative outputs by default (`incremental_streaming_output` off, which
    the adapter owns): each dict's `output_ids` and `meta_info["output_token_logprobs"]`
    hold everything so far, so the maker slices off what it already sent. It reports the
    cached prompt tokens on the first delta and usage on the last."""

    def __init__(self, request: WorkerRequest) -> None:
        self.request = request
        self.migrated = len(request.generated_token_ids)
        self.sent = 0  # output ids already turned into deltas
        self._first = True

    def delta(self, out: Mapping[str, Any]) -> TokenDelta:
        """The delta for one streamed output dict; raises EngineError for an abort that is
        an error (see `abort_error`)."""
        meta: Mapping[str, Any] = out.get("meta_info") or {}
        finish = meta.get("finish_reason")
        if isinstance(finish, Mapping) and (error := abort_error(finish)) is not None:
            raise error
        output_ids = list(out.get("output_ids") or ())
        new = output_ids[self.sent :]
        start, self.sent = self.sent, len(output_ids)
        prompt_tokens = len(self.request.token_ids)
        # SGLang prefilled the migrated tokens as prompt: its counts include them there.
        cached = min(int(meta.get("cached_tokens") or 0), prompt_tokens)
        reason = _FINISH.get(str(finish.get("type")), "stop") if isinstance(finish, Mapping) else None
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = _logprobs(
                new,
                (meta.get("output_token_logprobs") or [])[start : self.sent],
                (meta.get("output_top_logprobs") or [])[start : self.sent],
                self.request.logprobs,
            )
        first, self._first = self._first, False
        usage = None
        if reason is not None:
            usage = Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=self.migrated + int(meta.get("completion_tokens", self.sent)),
                cached_tokens=cached,
            )
        return TokenDelta(
            token_ids=new,
            logprobs=logprobs,
            finish_reason=reason,
            usage=usage,
            cached_tokens=cached if first else None,
        )


def _logprobs(
    token_ids: Sequence[int],
    sampled: Sequence[Sequence[Any]],
    tops: Sequence[Sequence[Sequence[Any]] | None],
    top: int,
) -> list[TokenLogprob]:
    """SGLang's logprob entries are (logprob, token_id, text or None) tuples
    (tokenizer_manager.py, `detokenize_logprob_tokens`): one per output token, and per output
    token a list of the `top_logprobs_num` most likely (None where it asked for none)."""
    out: list[TokenLogprob] = []
    for i, (token_id, entry) in enumerate(zip(token_ids, sampled, strict=True)):
        ranked = tops[i] if i < len(tops) else None
        out.append(
            TokenLogprob(
                token_id,
                float(entry[0]),
                [TopLogprob(int(t[1]), float(t[0])) for t in (ranked or ())[:top]],
            )
        )
    return out
