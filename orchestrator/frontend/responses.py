"""OpenAI response bodies and stream chunks as msgspec structs (built per token: no pydantic).

Field order and names follow OpenAI's wire format; `None` fields are written as null where
OpenAI writes them (`finish_reason`, `logprobs`), so clients that index them keep working."""

from __future__ import annotations

import msgspec

# ---------------------------------------------------------------- shared


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct):
    """OpenAI's names for a prediction's tokens (Predicted Outputs): here speculative decoding's
    draft tokens the model accepted, and those it rejected."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # Only for requests that were speculated on.
    completion_tokens_details: CompletionTokensDetails | None = None


class ModelInfo(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "weir"


class ModelList(msgspec.Struct):
    data: list[ModelInfo]
    object: str = "list"


# ---------------------------------------------------------------- chat


class TopLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class LogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(msgspec.Struct):
    content: list[LogprobEntry]


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"


# ---------------------------------------------------------------- completions


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    object: str = "text_completion"
