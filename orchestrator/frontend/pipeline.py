"""From worker deltas to per-choice text: detokenize, match stop strings, count usage.

A request has one or more choices (n per prompt); each is one worker request. `run_choice`
streams one choice's `ChoiceOutput`s; `merge` interleaves several choices as they arrive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from orchestrator.frontend import dispatch
from orchestrator.frontend.formatters import ChoiceOutput
from orchestrator.frontend.preprocessor import Preprocessor
from orchestrator.frontend.registry import ModelEntry
from orchestrator.frontend.responses import CompletionTokensDetails, PromptTokensDetails, UsageInfo
from orchestrator.frontend.stop import StopStringMatcher
from orchestrator.runtime.protocol import WorkerRequest
from router.protocols import RouteRequest


@dataclass(slots=True)
class ChoiceState:
    index: int
    request: WorkerRequest
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0


@dataclass(slots=True)
class Job:
    """Everything needed to run one HTTP request's choices."""

    request_id: str
    entry: ModelEntry
    preprocessor: Preprocessor
    choices: list[ChoiceState]
    stops: list[str]
    n: int  # choices per prompt
    migration_limit: int
    include_stop: bool = False  # vLLM's include_stop_str_in_output
    skip_special_tokens: bool = True
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def usage(self) -> UsageInfo:
        # Choices of one prompt share it: count the prompt (and its cache hits) once.
        firsts = self.choices[:: self.n]
        prompt = sum(c.prompt_tokens for c in firsts)
        cached = sum(c.cached_tokens for c in firsts)
        completion = sum(c.completion_tokens for c in self.choices)
        accepted = sum(c.accepted_draft_tokens for c in self.choices)
        rejected = sum(c.rejected_draft_tokens for c in self.choices)
        drafts = CompletionTokensDetails(accepted, rejected) if accepted or rejected else None
        return UsageInfo(prompt, completion, prompt + completion, PromptTokensDetails(cached), drafts)

    def record(self) -> None:
        usage = self.usage()
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrived
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        self.entry.metrics.finished(
            ttft, time.perf_counter() - self.arrived, usage.prompt_tokens, usage.completion_tokens, cached
        )


async def run_choice(job: Job, choice: ChoiceState) -> Outputs:
    request = choice.request
    route = RouteRequest(request.request_id, len(request.token_ids), request.block_hashes)
    detok = job.preprocessor.detokenizer(job.skip_special_tokens)
    stop = StopStringMatcher(job.stops, job.include_stop) if job.stops else None
    index = choice.index
    deltas = dispatch.generate(job.entry, request, route, job.migration_limit)
    try:
        async for delta in deltas:
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
            ids = delta.token_ids
            choice.completion_tokens += len(ids)
            finish: str | None = delta.finish_reason
            text = detok.step(ids, final=finish is not None)
            if delta.cached_tokens is not None:  # the first delta's: survives an early stop
                choice.cached_tokens = delta.cached_tokens
            if delta.usage is not None:
                choice.completion_tokens = delta.usage.completion_tokens
                choice.prompt_tokens = delta.usage.prompt_tokens
                choice.cached_tokens = delta.usage.cached_tokens
                choice.accepted_draft_tokens = delta.usage.accepted_draft_tokens
                choice.rejected_draft_tokens = delta.usage.rejected_draft_tokens
            if stop is not None:
                text, matched = stop.feed(text, final=finish is not None)
                if matched:
                    finish = "stop"
            if text or finish is not None or delta.logprobs:
                yield ChoiceOutput(index, text, delta.logprobs, finish)
            if finish is not None:
                return
    finally:
        # A stop string ends the choice before the worker does: closing cancels it there.
        await deltas.aclose()


Outputs = AsyncGenerator[ChoiceOutput, None]


def outputs(job: Job) -> Outputs:
    """All choices' outputs; a lone choice streams without the merging machinery."""
    if len(job.choices) == 1:
        return run_choice(job, job.choices[0])
    return merge([run_choice(job, c) for c in job.choices])


async def merge(streams: list[Outputs]) -> Outputs:
    """Outputs of several choices in arrival order; the first failure fails them all."""
    queue: asyncio.Queue[ChoiceOutput | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[ChoiceOutput]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
