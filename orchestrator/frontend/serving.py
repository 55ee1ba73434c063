"""The two generation endpoints: parse, preprocess, build the job, stream or collect.

Chat and text completions differ only in how the prompt is made (template vs. raw text or
token ids) and in the wire format (formatters.py); everything after that is shared."""

from __future__ import annotations

import asyncio
import time
import uuid

from orchestrator.frontend import pipeline, prompts
from orchestrator.frontend.asgi import DONE_EVENT, SSE_HEADERS, Exchange
from orchestrator.frontend.bodies import BodyParser
from orchestrator.frontend.config import FrontendConfig
from orchestrator.frontend.errors import InvalidRequest
from orchestrator.frontend.formatters import ChatFormatter, ChoiceResult, CompletionFormatter, Formatter
from orchestrator.frontend.metrics import Metrics
from orchestrator.frontend.params import (
    check_limits,
    check_token_ids,
    guided_spec,
    per_choice,
    resolve_max_tokens,
    sampling_options,
    stop_strings,
)
from orchestrator.frontend.preprocessor import Preprocessor
from orchestrator.frontend.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from orchestrator.frontend.registry import ModelEntry, ModelRegistry
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import WorkerRequest


class Serving:
    def __init__(self, config: FrontendConfig, registry: ModelRegistry, metrics: Metrics) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.bodies = BodyParser()

    async def chat(self, body: bytes, ex: Exchange) -> None:
        req = await self.bodies.parse(ChatCompletionRequest, body)
        check_limits(req, 1, self.config.max_stop_strings)
        entry = self.registry.get(req.model)
        pre = entry.require_preprocessor()
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        # A body that is large is a conversation whose template costs as much as tokenizing it.
        large = len(body) >= prompts.OFFLOAD_CHARS
        prompt = await prompts.chat_prompt(pre, req, large)
        ids = await prompts.encode(pre, prompt, False, entry.max_prompt_chars, "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        job = self._job(entry, pre, req, [ids], max_tokens, "messages", logprobs)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        fmt = ChatFormatter(
            f"chatcmpl-{job.request_id}",
            int(time.time()),
            req.model,
            len(job.choices),
            include_usage,
            pre.token_text,
            req.logprobs,
        )
        await self._respond(job, fmt, req.stream, include_usage, ex)

    async def completions(self, body: bytes, ex: Exchange) -> None:
        req = await self.bodies.parse(CompletionRequest, body)
        check_limits(req, prompts.prompt_count(req.prompt), self.config.max_stop_strings)
        entry = self.registry.get(req.model)
        pre = entry.require_preprocessor()
        token_ids = await prompts.completion_prompts(pre, req.prompt, entry.max_prompt_chars)
        job = self._job(entry, pre, req, token_ids, req.max_tokens, "prompt", req.logprobs)
        echo = None
        if req.echo:
            texts = [pre.decode(ids, skip_special_tokens=False) for ids in token_ids]
            echo = [texts[i // req.n] for i in range(len(job.choices))]
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        fmt = CompletionFormatter(
            f"cmpl-{job.request_id}",
            int(time.time()),
            req.model,
            include_usage,
            pre.token_text,
            req.logprobs is not None,
            echo,
        )
        await self._respond(job, fmt, req.stream, include_usage, ex)

    def _job(
        self,
        entry: ModelEntry,
        pre: Preprocessor,
        req: GenerationRequest,
        prompts: list[list[int]],
        requested_max: int | None,
        prompt_param: str,
        logprobs: int | None,
    ) -> pipeline.Job:
        card = entry.card
        check_token_ids(req, pre.vocab_size)
        sampling = sampling_options(req)
        guided = guided_spec(req)
        stop_ids = list(req.stop_token_ids or ()) + ([] if req.ignore_eos else pre.eos_token_ids)
        request_id = uuid.uuid4().hex
        choices: list[pipeline.ChoiceState] = []
        for p, ids in enumerate(prompts):
            if not ids:
                raise InvalidRequest("the prompt is empty", param=prompt_param)
            max_tokens = resolve_max_tokens(requested_max, len(ids), card.context_length, prompt_param)
            if req.min_tokens > max_tokens:
                raise InvalidRequest("min_tokens must not exceed max_tokens", param="min_tokens")
            base = WorkerRequest(
                request_id=request_id if len(prompts) == 1 else f"{request_id}-p{p}",
                token_ids=ids,
                max_tokens=max_tokens,
                sampling=sampling,
                block_hashes=block_hashes(ids, card.block_size, req.cache_salt),
                min_tokens=req.min_tokens,
                stop_token_ids=stop_ids,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                guided=guided,
                priority=req.priority,
                cache_salt=req.cache_salt,
            )
            for request in per_choice(base, req.n):
                choices.append(pipeline.ChoiceState(len(choices), request, len(ids)))
        return pipeline.Job(
            request_id,
            entry,
            pre,
            choices,
            stop_strings(req),
            req.n,
            self.config.migration_limit,
            include_stop=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
        )

    async def _respond(
        self, job: pipeline.Job, fmt: Formatter, stream: bool, include_usage: bool, ex: Exchange
    ) -> None:
        # After preprocessing, so the admitted request goes straight on to routing.
        admission = job.entry.admission
        await admission.admit()
        outputs = pipeline.outputs(job)
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                if stream:
                    await _stream(job, outputs, fmt, include_usage, ex)
                else:
                    await _collect(job, outputs, fmt, ex)
        finally:
            await outputs.aclose()  # the router hears on_finish before the next is admitted
            admission.release()
            job.record()


async def _stream(
    job: pipeline.Job, outputs: pipeline.Outputs, fmt: Formatter, include_usage: bool, ex: Exchange
) -> None:
    # Headers wait for the first output, so a failure before it (no worker, a request the
    # worker rejects) still gets a proper status code instead of an error inside a 200.
    first = await anext(outputs, None)
    await ex.start(200, SSE_HEADERS)
    if first is not None:
        await ex.write(fmt.chunk(first))
    async for out in outputs:
        await ex.write(fmt.chunk(out))
    await ex.finish(fmt.usage_chunk(job.usage()) + DONE_EVENT if include_usage else DONE_EVENT)


async def _collect(job: pipeline.Job, outputs: pipeline.Outputs, fmt: Formatter, ex: Exchange) -> None:
    results = [ChoiceResult(c.index) for c in job.choices]
    async for out in outputs:
        results[out.index].add(out)
    await ex.json(200, fmt.response(results, job.usage()))
