"""OpenAI request fields -> worker request fields (sampling, guided decoding, stops, lengths)."""

from __future__ import annotations

import json

import msgspec

from orchestrator.frontend.errors import InvalidRequest
from orchestrator.frontend.protocol import INT64_MAX, MAX_CHOICES, GenerationRequest
from orchestrator.runtime.protocol import GuidedSpec, SamplingOptions, WorkerRequest

# Every stop string is searched for in every streamed delta of every choice: this bound on
# their length, with `max_stop_strings` on their number, bounds that work per token.
MAX_STOP_CHARS = 256


def check_limits(req: GenerationRequest, prompt_count: int, max_stop_strings: int) -> None:
    """The request's size limits: cheap, so they run before anything whose cost grows with the
    input (templates, tokenizing, hashing)."""
    if prompt_count * req.n > MAX_CHOICES:
        raise InvalidRequest(f"at most {MAX_CHOICES} choices (prompts x n) per request", param="n")
    stops = stop_strings(req)
    if len(stops) > max_stop_strings:
        raise InvalidRequest(f"at most {max_stop_strings} stop strings per request", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequest(f"stop strings must be at most {MAX_STOP_CHARS} characters", param="stop")


def sampling_options(req: GenerationRequest) -> SamplingOptions:
    opts = SamplingOptions()
    if req.temperature is not None:
        opts.temperature = req.temperature
    if req.top_p is not None:
        opts.top_p = req.top_p
    if req.top_k is not None:
        opts.top_k = max(req.top_k, 0)  # vLLM's -1 and 0 both mean "off"
    if req.min_p is not None:
        opts.min_p = req.min_p
    opts.seed = req.seed
    if req.presence_penalty is not None:
        opts.presence_penalty = req.presence_penalty
    if req.frequency_penalty is not None:
        opts.frequency_penalty = req.frequency_penalty
    if req.repetition_penalty is not None:
        opts.repetition_penalty = req.repetition_penalty
    if req.logit_bias:
        opts.logit_bias = {int(k): v for k, v in req.logit_bias.items()}
    return opts


def guided_spec(req: GenerationRequest) -> GuidedSpec | None:
    """At most one constraint: OpenAI's `response_format` or one vLLM `guided_*` field."""
    specs: list[GuidedSpec] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        specs.append(GuidedSpec(kind="json_object"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidRequest("response_format json_schema needs a schema", param="response_format")
        specs.append(GuidedSpec(kind="json_schema", value=json.dumps(fmt.json_schema.json_schema)))
    if req.guided_json is not None:
        value = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        specs.append(GuidedSpec(kind="json_schema", value=value))
    if req.guided_regex is not None:
        specs.append(GuidedSpec(kind="regex", value=req.guided_regex))
    if req.guided_choice is not None:
        specs.append(GuidedSpec(kind="choice", value=list(req.guided_choice)))
    if req.guided_grammar is not None:
        specs.append(GuidedSpec(kind="grammar", value=req.guided_grammar))
    if len(specs) > 1:
        raise InvalidRequest("only one of response_format and guided_* may constrain the output")
    return specs[0] if specs else None


def check_token_ids(req: GenerationRequest, vocab_size: int) -> None:
    """Token ids the client names (logit_bias keys, stop_token_ids) must exist in the vocabulary."""
    for param, ids in (
        ("logit_bias", [int(key) for key in req.logit_bias or ()]),
        ("stop_token_ids", req.stop_token_ids or []),
    ):
        if not ids:
            continue
        # min and max run in C: a long list costs milliseconds, not a Python loop.
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)


def stop_strings(req: GenerationRequest) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def resolve_max_tokens(requested: int | None, prompt_len: int, context_length: int, prompt_param: str) -> int:
    """The completion budget: what was asked, or what the context leaves; 400 if it does not fit."""
    if prompt_len >= context_length:
        raise InvalidRequest(
            f"This model's maximum context length is {context_length} tokens, "
            f"but the prompt has {prompt_len} tokens.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return context_length - prompt_len
    if prompt_len + requested > context_length:
        raise InvalidRequest(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def per_choice(base: WorkerRequest, n: int) -> list[WorkerRequest]:
    """One worker request per choice; seeded requests get seed+i so choices differ but repeat."""
    if n == 1:
        return [base]
    out = []
    for i in range(n):
        seed = base.sampling.seed
        if seed is not None:
            seed = seed + i if seed + i <= INT64_MAX else seed - i  # stay a valid int64
        sampling = msgspec.structs.replace(base.sampling, seed=seed)
        out.append(msgspec.structs.replace(base, request_id=f"{base.request_id}-{i}", sampling=sampling))
    return out
