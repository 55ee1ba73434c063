"""Turn per-choice outputs into OpenAI's chat or text-completion wire format.

The streaming path pre-encodes each request's constant chunk prefix (id, object, created,
model) once, so a chunk costs one small msgspec encode plus a bytes join."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from orchestrator.frontend.responses import (
    ChatChoice,
    ChatCompletion,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    LogprobEntry,
    TopLogprobEntry,
    UsageInfo,
)
from orchestrator.runtime.protocol import TokenLogprob

_encode = msgspec.json.Encoder().encode

TokenText = Callable[[int], str]


@dataclass(slots=True)
class ChoiceOutput:
    """What one worker delta became after detokenizing and stop matching."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None


@dataclass(slots=True)
class ChoiceResult:
    """A whole choice, accumulated for a non-streaming response."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, out: ChoiceOutput) -> None:
        self.text.append(out.text)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason


class Formatter(Protocol):
    def chunk(self, out: ChoiceOutput) -> bytes: ...

    def usage_chunk(self, usage: UsageInfo) -> bytes: ...

    def response(self, results: list[ChoiceResult], usage: UsageInfo) -> bytes: ...


class _Chunks:
    """The pre-encoded frame around each SSE chunk's `choices` list."""

    def __init__(self, request_id: str, obj: str, created: int, model: str, include_usage: bool) -> None:
        self.head = b'data: {"id":%s,"object":"%s","created":%d,"model":%s,"choices":[' % (
            _encode(request_id),
            obj.encode(),
            created,
            _encode(model),
        )
        # With include_usage OpenAI writes "usage": null on every chunk but the last.
        self.tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        return self.head + b'],"usage":' + _encode(usage) + b"}\n\n"


class ChatFormatter(_Chunks):
    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        n: int,
        include_usage: bool,
        token_text: TokenText,
        logprobs: bool,
    ) -> None:
        super().__init__(request_id, "chat.completion.chunk", created, model, include_usage)
        self.request_id, self.created, self.model = request_id, created, model
        self.token_text = token_text
        self.logprobs = logprobs
        self._role_sent = [False] * n

    def chunk(self, out: ChoiceOutput) -> bytes:
        # The role travels with each choice's first content instead of costing its own chunk.
        if self._role_sent[out.index]:
            delta = ChatDelta(content=out.text) if out.text else ChatDelta()
        else:
            self._role_sent[out.index] = True
            delta = ChatDelta(role="assistant", content=out.text)
        logprobs = self._logprobs(out.logprobs) if self.logprobs and out.logprobs else None
        return (
            self.head + _encode(ChatStreamChoice(out.index, delta, logprobs, out.finish_reason)) + self.tail
        )

    def response(self, results: list[ChoiceResult], usage: UsageInfo) -> bytes:
        choices = [
            ChatChoice(
                r.index,
                ChatMessageOut("assistant", "".join(r.text)),
                self._logprobs(r.logprobs) if self.logprobs else None,
                r.finish_reason,
            )
            for r in results
        ]
        return _encode(ChatCompletion(self.request_id, self.created, self.model, choices, usage))

    def _logprobs(self, items: list[TokenLogprob]) -> ChatLogprobs:
        text = self.token_text
        entries = []
        for item in items:
            token = text(item.token_id)
            top = [
                TopLogprobEntry(text(t.token_id), t.logprob, list(text(t.token_id).encode()))
                for t in item.top
            ]
            entries.append(LogprobEntry(token, item.logprob, list(token.encode()), top))
        return ChatLogprobs(entries)


class CompletionFormatter(_Chunks):
    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        include_usage: bool,
        token_text: TokenText,
        logprobs: bool,
        echo: list[str] | None,
    ) -> None:
        super().__init__(request_id, "text_completion", created, model, include_usage)
        self.request_id, self.created, self.model = request_id, created, model
        self.token_text = token_text
        self.logprobs = logprobs
        self.echo = echo  # per choice index: the prompt text to prepend
        self._offsets: dict[int, int] = {}

    def chunk(self, out: ChoiceOutput) -> bytes:
        text = out.text
        if self.echo is not None and out.index not in self._offsets:
            text = self.echo[out.index] + text
        logprobs = self._logprobs(out.index, out.logprobs) if self.logprobs and out.logprobs else None
        self._offsets.setdefault(out.index, 0)
        return self.head + _encode(CompletionChoice(out.index, text, logprobs, out.finish_reason)) + self.tail

    def response(self, results: list[ChoiceResult], usage: UsageInfo) -> bytes:
        choices = []
        for r in results:
            prefix = self.echo[r.index] if self.echo is not None else ""
            logprobs = self._logprobs(r.index, r.logprobs) if self.logprobs else None
            choices.append(CompletionChoice(r.index, prefix + "".join(r.text), logprobs, r.finish_reason))
        return _encode(Completion(self.request_id, self.created, self.model, choices, usage))

    def _logprobs(self, index: int, items: list[TokenLogprob]) -> CompletionLogprobs:
        text = self.token_text
        offset = self._offsets.get(index, 0)
        tokens, values, tops, offsets = [], [], [], []
        for item in items:
            token = text(item.token_id)
            tokens.append(token)
            values.append(item.logprob)
            tops.append({text(t.token_id): t.logprob for t in item.top})
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return CompletionLogprobs(tokens, values, tops, offsets)
