"""What a worker checks on the wire before its engine sees a request: token ids within the
vocabulary, prompt length, and block hashes recomputed from the tokens (a mocker engine, its
real prefix cache, over the real request plane)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest

from backends.mocker.config import MockerConfig
from backends.mocker.engine import MockerEngine
from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.events import make_event_plane
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import TokenDelta, WorkerRequest
from orchestrator.runtime.request_plane import RequestPlaneClient, TcpWorkerClient
from orchestrator.runtime.worker_host import WorkerHost

BLOCK = 4
VOCAB = 1000


@pytest.fixture
async def worker() -> AsyncIterator[TcpWorkerClient]:
    discovery, events = make_discovery(None, "test"), make_event_plane(None)
    config = MockerConfig(block_size=BLOCK, vocab_size=VOCAB, context_length=64, speedup=1000.0)
    host = WorkerHost(MockerEngine(config), discovery, events, namespace="test", instance_id="w")
    await host.start()
    client = RequestPlaneClient()
    yield TcpWorkerClient(client, host.address)
    await client.close()
    await host.stop()
    await events.close()
    await discovery.close()


async def first_delta(worker: TcpWorkerClient, request: WorkerRequest) -> TokenDelta:
    stream = worker.generate(request)
    try:
        return await anext(stream)
    finally:
        await stream.aclose()


def req(request_id: str, tokens: list[int], **fields: object) -> WorkerRequest:
    return WorkerRequest(request_id=request_id, token_ids=tokens, max_tokens=2, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"token_ids": [1, 2**63 - 1]},
        {"token_ids": [-5, 1]},
        {"token_ids": [10**12]},
        {"token_ids": [VOCAB]},
        {"stop_token_ids": [VOCAB + 1]},
        {"token_ids": list(range(65))},  # over the context length
    ],
)
async def test_ids_outside_the_vocabulary_or_too_long_a_prompt_are_invalid(
    worker: TcpWorkerClient, bad: dict[str, list[int]]
) -> None:
    request = req("bad", bad.get("token_ids", [1, 2, 3]), stop_token_ids=bad.get("stop_token_ids", []))
    with pytest.raises(EngineError) as refused:
        await first_delta(worker, request)
    assert refused.value.code == "invalid_request"
    assert (await first_delta(worker, req("ok", [VOCAB - 1, 0, 5]))).token_ids  # still serving


async def test_another_requests_block_hashes_never_buy_its_cache(worker: TcpWorkerClient) -> None:
    victim = list(range(100, 112))
    await first_delta(worker, req("victim", victim, block_hashes=block_hashes(victim, BLOCK)))
    again = await first_delta(worker, req("victim-again", victim))
    assert again.cached_tokens == 8  # the cache is there (the last block is recomputed)
    attacker = list(range(500, 512))
    with pytest.raises(EngineError) as refused:
        await first_delta(worker, req("attacker", attacker, block_hashes=block_hashes(victim, BLOCK)))
    assert refused.value.code == "invalid_request"
    honest = await first_delta(worker, req("attacker-honest", attacker))
    assert not honest.cached_tokens


async def test_hashes_are_salted_as_the_request_says(worker: TcpWorkerClient) -> None:
    tokens = list(range(200, 212))
    salted = block_hashes(tokens, BLOCK, "tenant-a")
    assert (await first_delta(worker, req("a", tokens, cache_salt="tenant-a", block_hashes=salted))).token_ids
    with pytest.raises(EngineError):  # unsalted hashes under a salt: not what the tokens give
        await first_delta(worker, req("b", tokens, cache_salt="tenant-b", block_hashes=salted))
    assert not (await first_delta(worker, req("c", tokens, cache_salt="tenant-b"))).cached_tokens


async def test_a_migrated_requests_hashes_cover_its_generated_tokens(worker: TcpWorkerClient) -> None:
    # The CI failure this guards: a request migrated after its output crossed a block boundary
    # carries hashes of prompt + output (frontend/dispatch.py), and the worker refused them as
    # "not the prompt's".
    prompt, generated = list(range(300, 306)), list(range(400, 404))
    resumed = WorkerRequest(
        request_id="resumed",
        token_ids=prompt,
        generated_token_ids=generated,
        block_hashes=block_hashes([*prompt, *generated], BLOCK),
        max_tokens=len(generated) + 2,
    )
    assert (await first_delta(worker, resumed)).token_ids
    with pytest.raises(EngineError) as refused:  # the prompt's hashes alone are not what it prefills
        await first_delta(worker, msgspec.structs.replace(resumed, block_hashes=block_hashes(prompt, BLOCK)))
    assert refused.value.code == "invalid_request"
    out_of_vocab = msgspec.structs.replace(resumed, generated_token_ids=[VOCAB], block_hashes=[])
    with pytest.raises(EngineError):
        await first_delta(worker, out_of_vocab)
