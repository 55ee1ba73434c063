"""Disaggregation on DeepInfer's engines: a prefill-only request on one engine, then its decode
on another engine that loads the prompt's KV from the first one's records instead of computing
it, its partial last block included, so that its first step is a decode step. Greedy output is
token-identical to one engine serving the request whole; records that are missing, damaged or
of another layout are computed instead; held blocks survive eviction pressure until released."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from backends.deepinfer.config import EngineConfig
from backends.deepinfer.engine import Engine
from kvbm import records
from orchestrator.runtime.hashing import prompt_block_names, tail_hash
from orchestrator.runtime.protocol import KvTransfer, SamplingOptions, WorkerRequest
from tests.deepinfer.device import DEVICE, DTYPE

BLOCK = 16
GREEDY = SamplingOptions(temperature=0.0)


def make_engine(model_dir: Path, **kw: object) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir), device=DEVICE, dtype=DTYPE, num_kv_blocks=64, block_size=BLOCK, **kw
        )
    )  # type: ignore[arg-type]


def run(engine: Engine, request: WorkerRequest) -> list[int]:
    """The request's generated tokens, the engine stepped until it is done."""
    engine.add(request)
    tokens: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += [t.token_id for t in o.new_tokens]
    return tokens


def request(rid: str, tokens: list[int], max_tokens: int, **kw: object) -> WorkerRequest:
    return WorkerRequest(
        request_id=rid, token_ids=tokens, max_tokens=max_tokens, ignore_eos=True, sampling=GREEDY, **kw
    )  # type: ignore[arg-type]


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def disaggregated(
    prefill: Engine, decode: Engine, tokens: list[int], max_tokens: int, damage: int | None = None
) -> tuple[list[int], KvTransfer, int]:
    """Prefill on one engine, decode on the other: every generated token, the transfer, and
    how many tokens the decode engine's first step computed (1 when the whole prompt arrived).
    `damage`: flip the last byte of that record on the way."""
    first = run(prefill, request("r", tokens, max_tokens, prefill_only=True))
    assert len(first) == 1
    transfer = prefill.transfer("r")
    sent = prefill.read_transfer("r")
    assert transfer is not None and sent is not None and len(sent) == len(transfer.block_hashes)
    if damage is not None:
        sent[damage] = sent[damage][:-1] + bytes([sent[damage][-1] ^ 0xFF])
    decode.add(
        request("r", tokens, max_tokens, generated_token_ids=first, kv_transfer=transfer), arriving=True
    )
    assert decode.step() == [] and decode.last_step_tokens == 0  # nothing runs before its KV
    decode.arrive("r", decode.check_arrived(transfer, sent))
    rest: list[int] = []
    computed: list[int] = []  # tokens each step ran: the first one is the prompt's uncached rest
    while decode.has_unfinished():
        for o in decode.step():
            rest += [t.token_id for t in o.new_tokens]
        computed.append(decode.last_step_tokens)
    prefill.release_transfer("r")
    return first + rest, transfer, computed[0]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_prefill_then_decode_elsewhere_equals_one_engine(
    arch: str, tiny_llama_dir: Path, tiny_deepseek_dir: Path
) -> None:
    model_dir = tiny_llama_dir if arch == "llama" else tiny_deepseek_dir
    tokens = prompt(5 * BLOCK + 7)
    whole = run(make_engine(model_dir), request("w", tokens, 12))
    got, transfer, computed = disaggregated(make_engine(model_dir), make_engine(model_dir), tokens, 12)
    assert got == whole
    assert len(transfer.block_hashes) == 6  # five full blocks and the partial one
    assert computed == 1  # the whole prompt came over: the first step decodes the first token


def test_a_damaged_or_foreign_record_is_computed_instead(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    tokens = prompt(4 * BLOCK + 3, seed=1)
    whole = run(make_engine(tiny_llama_dir), request("w", tokens, 8))
    got, _, computed = disaggregated(
        make_engine(tiny_llama_dir), make_engine(tiny_llama_dir), tokens, 8, damage=2
    )
    # The blocks before the damaged one came over; the rest of the prompt was computed.
    assert got == whole and computed == len(tokens) + 1 - 2 * BLOCK
    # Another model's records never load, whatever their hashes claim.
    prefill = make_engine(tiny_qwen2_dir)
    run(prefill, request("q", tokens, 8, prefill_only=True))
    transfer = prefill.transfer("q")
    sent = prefill.read_transfer("q")
    assert transfer is not None and sent is not None
    decode = make_engine(tiny_llama_dir)
    assert decode.check_arrived(msgspec.structs.replace(transfer, layout=decode.layout), sent) == {}


def test_held_blocks_outlive_eviction_pressure_until_released(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    tokens = prompt(3 * BLOCK + 1, seed=2)
    run(engine, request("p", tokens, 4, prefill_only=True))
    sent = engine.read_transfer("p")
    assert sent is not None and len(sent) == 4  # three full blocks and the one-token tail
    held = engine.scheduler.held["p"]
    assert held.tail_tokens == 1
    # Prompts that need every other block of the cache: the held four must stay untouched.
    for i in range(4):
        run(engine, request(f"x{i}", prompt(59 * BLOCK - 8, seed=10 + i), 2))
    assert engine.read_transfer("p") == sent
    pool = engine.scheduler.kv_cache.pool
    assert all(pool.blocks[b].ref_count == 1 for b, _ in held.blocks)
    engine.release_transfer("p")
    assert engine.read_transfer("p") is None and engine.transfer("p") is None
    assert all(pool.blocks[b].ref_count == 0 for b, _ in held.blocks)
    engine.release_transfer("p")  # twice, or unknown: nothing happens


def test_a_prompt_shorter_than_a_block_comes_over_whole(tiny_llama_dir: Path) -> None:
    tokens = prompt(BLOCK - 3, seed=4)
    whole = run(make_engine(tiny_llama_dir), request("w", tokens, 9))
    got, transfer, computed = disaggregated(
        make_engine(tiny_llama_dir), make_engine(tiny_llama_dir), tokens, 9
    )
    assert got == whole and len(transfer.block_hashes) == 1 and computed == 1


def test_records_name_their_blocks(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    run(engine, request("n", prompt(2 * BLOCK + 5), 3, prefill_only=True))
    transfer = engine.transfer("n")
    sent = engine.read_transfer("n")
    assert transfer is not None and sent is not None
    # Named as the prompt's blocks: their hashes, then the partial block's tail hash.
    assert transfer.block_hashes == prompt_block_names(prompt(2 * BLOCK + 5), BLOCK)
    assert transfer.block_hashes[-1] == tail_hash(prompt(2 * BLOCK + 5), BLOCK)
    for seq_hash, record in zip(transfer.block_hashes, sent, strict=True):
        payload = records.decode(record, seq_hash, engine.layout)
        assert payload is not None and len(payload) == transfer.block_bytes


def test_smollm2_disaggregated_equals_aggregated(smollm2_dir: Path) -> None:
    tokens = prompt(3 * BLOCK + 9, seed=3)
    whole = run(make_engine(smollm2_dir), request("w", tokens, 10))
    got, _, computed = disaggregated(make_engine(smollm2_dir), make_engine(smollm2_dir), tokens, 10)
    assert got == whole and computed == 1


def test_a_first_token_that_ends_the_request_holds_nothing(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    first = run(engine, request("one", prompt(3 * BLOCK), 1, prefill_only=True))
    assert len(first) == 1
    assert engine.transfer("one") is None and engine.scheduler.held == {}
    assert engine.scheduler.kv_cache.num_active_blocks == 0
