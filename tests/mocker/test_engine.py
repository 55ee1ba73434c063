"""MockerEngine: the mocker behind the Engine protocol, paced on an asyncio loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from backends.mocker.config import MockerConfig
from backends.mocker.core import MockerCore
from backends.mocker.engine import MockerEngine
from orchestrator.runtime.engine import Engine
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import SamplingOptions, TokenDelta, WorkerRequest
from tests.waiting import eventually

FAST = 1e6  # speedup: steps take no wall time to speak of


def request(rid: str, prompt: int = 100, max_tokens: int = 8, seed: int | None = None) -> WorkerRequest:
    return WorkerRequest(
        request_id=rid,
        token_ids=list(range(3000, 3000 + prompt)),
        max_tokens=max_tokens,
        sampling=SamplingOptions(seed=seed),
        ignore_eos=True,  # these tests want exact lengths; tests/mocker/test_core.py covers EOS
    )


async def collect(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [delta async for delta in stream]


@pytest.fixture
async def engine() -> AsyncIterator[MockerEngine]:
    eng = MockerEngine(MockerConfig(model_name="mock-a", model_path="/tmp/tok", speedup=FAST))
    await eng.start()
    yield eng
    await eng.stop()


async def test_card_describes_the_mocker(engine: MockerEngine) -> None:
    as_engine: Engine = engine  # mypy checks that MockerEngine satisfies the Engine protocol
    card = as_engine.card
    assert (card.name, card.model_path, card.backend) == ("mock-a", "/tmp/tok", "mocker")
    assert (card.block_size, card.total_kv_blocks, card.max_num_seqs) == (64, 16_384, 256)


async def test_a_request_streams_to_its_end_with_usage(engine: MockerEngine) -> None:
    deltas = await collect(engine.generate(request("a", max_tokens=6, seed=11)))
    tokens = [t for d in deltas for t in d.token_ids]
    last = deltas[-1]
    assert last.finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    assert last.usage is not None and (last.usage.prompt_tokens, last.usage.completion_tokens) == (100, 6)
    core = MockerCore(MockerConfig())  # the same seed in a bare core gives the same tokens
    core.add(request("other", max_tokens=6, seed=11))
    expected = []
    while core.has_work():
        expected += [t for o in core.step().outputs for t in o.token_ids]
    assert tokens == expected


async def test_tokens_ready_together_travel_together(engine: MockerEngine) -> None:
    stream = engine.generate(request("slow-reader", max_tokens=40))
    first = await anext(stream)
    await eventually(lambda: not engine.core.has_work())  # the engine generates every token meanwhile
    rest = await collect(stream)
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 40
    assert len(rest) < 39 and max(len(d.token_ids) for d in rest) > 1


async def test_closing_the_stream_aborts_and_frees_blocks(engine: MockerEngine) -> None:
    stream = engine.generate(request("gone", prompt=640, max_tokens=10_000))
    await anext(stream)
    assert engine.load().active_blocks > 0
    await stream.aclose()
    load = engine.load()
    assert (load.active_requests, load.waiting_requests, load.active_blocks) == (0, 0, 0)


async def test_a_repeated_prompt_reports_cached_tokens(engine: MockerEngine) -> None:
    await collect(engine.generate(request("one", prompt=1000, max_tokens=2)))
    deltas = await collect(engine.generate(request("two", prompt=1000, max_tokens=2)))
    usage = deltas[-1].usage
    assert usage is not None and usage.cached_tokens == 960


async def test_bad_requests_are_typed_errors(engine: MockerEngine) -> None:
    with pytest.raises(EngineError) as info:
        await collect(engine.generate(request("empty", prompt=0)))
    assert info.value.code == "invalid_request"
    stream = engine.generate(request("dup", max_tokens=1000))
    await anext(stream)
    with pytest.raises(EngineError, match="already in use"):
        await collect(engine.generate(request("dup")))
    await stream.aclose()


async def test_stop_ends_in_flight_requests_with_abort() -> None:
    eng = MockerEngine(MockerConfig(speedup=1.0))
    await eng.start()
    stream = eng.generate(request("long", max_tokens=10_000))
    await anext(stream)
    await eng.stop()
    rest = await collect(stream)
    assert rest[-1].finish_reason == "abort" and rest[-1].usage is not None
    with pytest.raises(EngineError) as info:
        await collect(eng.generate(request("late")))
    assert info.value.code == "unavailable"


async def test_wall_time_follows_simulated_time_over_speedup() -> None:
    config = MockerConfig(speedup=4.0)
    eng = MockerEngine(config)
    await eng.start()
    started = time.monotonic()
    await collect(eng.generate(request("paced", prompt=1000, max_tokens=10)))
    elapsed = time.monotonic() - started
    await eng.stop()
    simulated_s = eng.core.clock_ms / 1000  # about 32 ms prefill + 9 decodes of about 5.8 ms
    assert simulated_s > 0.08
    assert elapsed >= 0.9 * simulated_s / config.speedup


async def test_kv_events_and_snapshot_agree(engine: MockerEngine) -> None:
    await collect(engine.generate(request("kv", prompt=300, max_tokens=2)))
    batches = engine.take_kv_events()
    assert [b.event_id for b in batches] == list(range(1, len(batches) + 1))
    stored = {h for b in batches for e in b.events for h in getattr(e, "blocks", [])}
    assert stored == set(engine.kv_snapshot().blocks["device"]) and len(stored) == 4


async def test_many_engines_share_one_process() -> None:
    engines = [MockerEngine(MockerConfig(model_name=f"m{i}", speedup=FAST)) for i in range(8)]
    for eng in engines:
        await eng.start()
    jobs = [
        collect(eng.generate(request(f"e{i}-r{j}", prompt=50 + j, max_tokens=16, seed=j)))
        for i, eng in enumerate(engines)
        for j in range(25)
    ]
    results = await asyncio.gather(*jobs)
    for eng in engines:
        await eng.stop()
    assert all(r[-1].finish_reason == "length" for r in results)
    assert all(sum(len(d.token_ids) for d in r) == 16 for r in results)
    # The same seed and prompt on different engines gives the same tokens.
    by_engine = [[t for d in results[i * 25 + 3] for t in d.token_ids] for i in range(8)]
    assert all(tokens == by_engine[0] for tokens in by_engine)
    assert all(eng.load().active_blocks == 0 for eng in engines)


async def test_the_first_delta_carries_the_prompts_cached_tokens(engine: MockerEngine) -> None:
    await collect(engine.generate(request("warm", prompt=200, max_tokens=2)))
    deltas = await collect(engine.generate(request("again", prompt=200, max_tokens=4)))
    final = deltas[-1].usage
    assert final is not None and final.cached_tokens == 192  # 3 full blocks of 64
    assert deltas[0].cached_tokens == 192
    assert all(d.cached_tokens is None for d in deltas[1:])


async def test_a_prefill_then_a_decode_elsewhere_continue_one_stream() -> None:
    """A prefill-only request ends after one token with the KV it holds; a decode engine given
    those records loads the prompt instead of computing it, after the transfer's simulated
    time, and produces what one engine serving the request whole does."""
    config = MockerConfig(model_name="mock-d", speedup=FAST)
    whole_engine, prefill, decode = MockerEngine(config), MockerEngine(config), MockerEngine(config)
    for eng in (whole_engine, prefill, decode):
        await eng.start()
    try:
        whole = [
            t
            for d in await collect(whole_engine.generate(request("w", prompt=300, max_tokens=6)))
            for t in d.token_ids
        ]
        first = await collect(
            prefill.generate(
                msgspec.structs.replace(request("w", prompt=300, max_tokens=6), prefill_only=True)
            )
        )
        [delta] = first
        assert delta.token_ids == whole[:1] and delta.finish_reason == "length"
        transfer = delta.kv_transfer
        assert transfer is not None and len(transfer.block_hashes) == 5  # 4 full blocks, 1 partial
        sent = prefill.read_transfer("w")
        assert sent is not None and len(sent) == len(transfer.block_hashes)
        follow = msgspec.structs.replace(
            request("w", prompt=300, max_tokens=6), generated_token_ids=whole[:1], kv_transfer=transfer
        )
        here = asyncio.Event()

        async def arriving() -> list[bytes]:
            await here.wait()
            return sent

        # While its KV travels, the request waits in the engine (LOADING_KV), counted in its load.
        decoding = asyncio.create_task(collect(decode.generate(follow, arriving())))
        await eventually(lambda: decode.load().waiting_requests == 1)
        assert decode.load().active_requests == 0
        here.set()
        rest = await decoding
        assert whole[:1] + [t for d in rest for t in d.token_ids] == whole
        # The prompt's full blocks came from the prefill into the decode's cache (the partial one
        # is loaded too, uncached while it fills; the prompt's own cache hits are the prefill's
        # to report).
        assert set(transfer.block_hashes[:4]) <= set(decode.kv_snapshot().blocks["device"])
        assert rest[0].cached_tokens == 0
        assert decode.core.transfer_ms(5) == pytest.approx(5 * 64 * config.kv_bytes_per_token / 25e6)
        prefill.release_transfer("w")
        assert prefill.read_transfer("w") is None
    finally:
        for eng in (whole_engine, prefill, decode):
            await eng.stop()


async def test_a_request_waiting_for_blocks_held_for_a_transfer_runs_once_they_are_released() -> None:
    """Nothing can run while a transfer's hold keeps the blocks a request needs: the engine
    waits for a change rather than spinning, and the release is one."""
    eng = MockerEngine(MockerConfig(model_name="mock-h", num_blocks=8, speedup=FAST))
    await eng.start()
    try:
        held = msgspec.structs.replace(request("held", prompt=300, max_tokens=2), prefill_only=True)
        await collect(eng.generate(held))  # 5 of the 8 blocks held for its transfer
        other = msgspec.structs.replace(request("next", prompt=300, max_tokens=2), token_ids=list(range(300)))
        waiting = asyncio.create_task(collect(eng.generate(other)))  # no prefix shared: 5 blocks
        await eventually(lambda: eng.load().waiting_requests == 1)
        assert not waiting.done()
        eng.release_transfer("held")
        deltas = await asyncio.wait_for(waiting, 10)
        assert deltas[-1].finish_reason == "length"
    finally:
        await eng.stop()
