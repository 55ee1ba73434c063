"""OpenAI request bodies as pydantic models, with OpenAI's field names.

Only requests are pydantic: they are validated once per request. Responses and stream chunks
are msgspec structs (see `responses.py`), because they are built per token.

Unknown fields are accepted and logged once per field name, as vLLM does, so newer clients
keep working; the log is bounded (`MAX_REPORTED_UNKNOWN` names, each cut to
`MAX_REPORTED_NAME` characters, one line per request), so clients inventing names cannot fill
the log or the process's memory. vLLM-style extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`, `guided_*`,
`chat_template_kwargs`) are accepted too."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger("weir.frontend")

# Field names already reported; a process-wide set keeps the log to one line per name. Once it
# holds MAX_REPORTED_UNKNOWN names, new ones are no longer reported (nor remembered).
MAX_REPORTED_UNKNOWN = 256
MAX_REPORTED_NAME = 64
# n x prompts; each choice is a worker request.
MAX_CHOICES = 256
# Biases applied at every sampling step: far more than any use needs (a few dozen words).
MAX_LOGIT_BIAS = 1024
# Far past any chat a context holds; bounds what one request makes the validator walk.
MAX_MESSAGES = 16_384
# Names listed in one request's log line; the rest of that request's new names are counted.
_NAMES_PER_LINE = 8
_reported_unknown: set[str] = set()

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @model_validator(mode="after")
    def _report_unknown(self) -> _Lenient:
        if self.model_extra and len(_reported_unknown) < MAX_REPORTED_UNKNOWN:
            _report_new_names(type(self).__name__, self.model_extra)
        return self


def _report_new_names(model: str, extra: dict[str, Any]) -> None:
    new: list[str] = []
    for name in extra:
        short = name[:MAX_REPORTED_NAME]
        if short not in _reported_unknown:
            if len(_reported_unknown) >= MAX_REPORTED_UNKNOWN:
                break
            _reported_unknown.add(short)
            new.append(short)
    if not new:
        return
    more = f" and {len(new) - _NAMES_PER_LINE} more" if len(new) > _NAMES_PER_LINE else ""
    full = len(_reported_unknown) >= MAX_REPORTED_UNKNOWN
    log.warning(
        "ignoring unknown fields %s%s in %s (logged once)%s",
        new[:_NAMES_PER_LINE],
        more,
        model,
        "; no further unknown fields will be logged" if full else "",
    )


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    name: str = "schema"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class GenerationRequest(_Lenient):
    """Fields shared by chat and text completions."""

    model: str
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _few_enough_biases(cls, v: Any) -> Any:
        if isinstance(v, dict) and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries per request")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return v


def _check_length(value: Any, limit: int, what: str) -> Any:
    """A list's length, checked before its items are validated: pydantic validates every item
    (of every union member) first, which for a body of millions of tiny items takes seconds on
    the event loop."""
    if isinstance(value, list) and len(value) > limit:
        raise ValueError(f"at most {limit} {what} per request")
    return value


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _few_enough_messages(cls, v: Any) -> Any:
        return _check_length(v, MAX_MESSAGES, "messages")


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_enough_prompts(cls, v: Any) -> Any:
        # A list of token ids is one prompt (bounded by the context later); a list of texts
        # or of token lists is a batch, at most one prompt per choice. A token list with a
        # stray non-integer is refused here, before each union member reports every item.
        if not isinstance(v, list) or not v:
            return v
        if type(v[0]) is int:
            if not all(type(token) is int for token in v):
                raise ValueError("a prompt of token ids holds only integers")
            return v
        return _check_length(v, MAX_CHOICES, "prompts")

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (ranking candidates is not supported)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self
