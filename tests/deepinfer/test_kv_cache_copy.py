"""`PagedKVCache`: whole KV blocks copied out of the paged cache as bytes and back.

Round trips on hand-made attention- and MLA-shaped caches in every supported dtype, the runner's
own cache for a tiny Llama and DeepSeek-V3, and the property an offloading block manager
relies on: a generation whose prompt blocks were zeroed and then restored from their bytes is
token- and logit-identical to one left alone (and one left zeroed is not, so the check bites).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backends.deepinfer import kv_cache
from backends.deepinfer.config import EngineConfig
from backends.deepinfer.engine import Engine
from backends.deepinfer.kv_cache import PagedKVCache
from backends.deepinfer.model_runner import ModelRunner
from backends.deepinfer.outputs import SchedulerOutput
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest
from tests.deepinfer.device import DEVICE, DTYPE

NUM_BLOCKS, BLOCK_SIZE = 8, 4


def attention_tensors(dtype: torch.dtype, layers: int = 2) -> list[torch.Tensor]:
    """K and V per layer, `[num_blocks, block_size, kv_heads, head_dim]`, random."""
    return [torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, 3).to(dtype) for _ in range(2 * layers)]


def mla_tensors(dtype: torch.dtype, layers: int = 3) -> list[torch.Tensor]:
    """One latent cache per layer, `[num_blocks, block_size, kv_lora_rank + rope_dim]`."""
    return [torch.randn(NUM_BLOCKS, BLOCK_SIZE, 5).to(dtype) for _ in range(layers)]


def zero_blocks(cache: PagedKVCache, block_ids: list[int]) -> None:
    for t in cache.tensors:
        t[block_ids] = 0


@pytest.mark.parametrize("chunk_blocks", [1, 2, 100])
@pytest.mark.parametrize("make", [attention_tensors, mla_tensors])
def test_blocks_read_into_given_memory_are_their_payloads(
    chunk_blocks: int, make: Callable[[torch.dtype], list[torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Into a host store's slots, as the offload writes them: on the CPU through the cache's
    own buffer, a chunk of blocks at a time (one, two, or all three here)."""
    torch.manual_seed(0)
    cache = PagedKVCache([t.to(DEVICE) for t in make(torch.bfloat16)])
    monkeypatch.setattr(kv_cache, "GATHER_CHUNK_BYTES", chunk_blocks * cache.block_bytes)
    ids = [6, 1, 2]
    arena = bytearray(4 * cache.block_bytes)  # slots of a host store, one left unused
    slots = [memoryview(arena)[i * cache.block_bytes : (i + 1) * cache.block_bytes] for i in (3, 0, 1)]
    cache.read_blocks_into(ids, slots)
    assert [bytes(slot) for slot in slots] == cache.read_blocks(ids)
    assert arena[2 * cache.block_bytes : 3 * cache.block_bytes] == bytes(cache.block_bytes)
    with pytest.raises(ValueError, match="destinations"):
        cache.read_blocks_into(ids, slots[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [attention_tensors, mla_tensors])
def test_round_trip_restores_exactly_the_blocks_written(
    dtype: torch.dtype, make: Callable[[torch.dtype], list[torch.Tensor]]
) -> None:
    torch.manual_seed(0)
    tensors = make(dtype)
    cache = PagedKVCache(tensors)
    original = [t.clone() for t in tensors]
    ids = [5, 0, 3]
    payloads = cache.read_blocks(ids)
    assert cache.num_blocks == NUM_BLOCKS
    assert cache.block_bytes == sum(t[0].numel() * t.element_size() for t in tensors)
    assert [len(p) for p in payloads] == [cache.block_bytes] * len(ids)
    for block_id, payload in zip(ids, payloads, strict=True):  # the documented byte order
        assert payload == b"".join(
            t[block_id].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors
        )
    zero_blocks(cache, ids)
    tensors[0][1] = 7  # a block not written back must keep what it holds
    cache.write_blocks(ids, payloads)
    for t, before in zip(tensors, original, strict=True):
        for block_id in range(NUM_BLOCKS):
            if block_id != 1 or t is not tensors[0]:
                assert torch.equal(t[block_id], before[block_id])
    assert bool((tensors[0][1] == 7).all())
    # Payloads are portable between caches of one layout: block 5's bytes loaded into block 7.
    cache.write_blocks([7], payloads[:1])
    assert all(torch.equal(t[7], t[5]) for t in tensors)
    assert cache.read_blocks([]) == []
    cache.write_blocks([], [])


def test_layout_names_dtype_block_size_and_shapes() -> None:
    base = PagedKVCache(attention_tensors(torch.float32)).layout
    assert base == ("float32", BLOCK_SIZE, ((BLOCK_SIZE, 2, 3),) * 4)
    assert PagedKVCache(attention_tensors(torch.float32)).layout == base
    assert PagedKVCache(attention_tensors(torch.bfloat16)).layout != base
    assert PagedKVCache(attention_tensors(torch.float32, layers=3)).layout != base
    assert PagedKVCache([torch.zeros(NUM_BLOCKS, 2 * BLOCK_SIZE, 2, 3)] * 4).layout != base
    assert PagedKVCache([torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 3, 2)] * 4).layout != base
    assert PagedKVCache(mla_tensors(torch.float32)).layout != base
    hash(base)  # usable as a key


def test_bad_writes_raise_before_writing_anything() -> None:
    tensors = attention_tensors(torch.float32)
    cache = PagedKVCache(tensors)
    before = [t.clone() for t in tensors]
    good = cache.read_blocks([1, 2])
    with pytest.raises(ValueError, match="expected"):
        cache.write_blocks([1, 2], [good[0], good[1][:-1]])
    with pytest.raises(ValueError, match="payloads"):
        cache.write_blocks([1, 2], good[:1])
    with pytest.raises(ValueError, match="repeated"):
        cache.write_blocks([1, 1], good)
    with pytest.raises(ValueError, match="outside"):
        cache.write_blocks([1, NUM_BLOCKS], good)
    with pytest.raises(ValueError, match="outside"):
        cache.read_blocks([-1])
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    with pytest.raises(ValueError, match="disagree"):
        PagedKVCache([torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2), torch.zeros(NUM_BLOCKS + 1, BLOCK_SIZE, 2)])
    with pytest.raises(ValueError, match="mix"):
        PagedKVCache([torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2), torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2).half()])


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_runner_cache_covers_every_layer(arch: str, tiny_llama_dir: Path, tiny_deepseek_dir: Path) -> None:
    model_dir = tiny_llama_dir if arch == "llama" else tiny_deepseek_dir
    runner = ModelRunner(
        EngineConfig(
            model=str(model_dir), device=DEVICE, dtype=DTYPE, block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS
        )
    )
    cache = runner.kv_cache
    layers = runner.hf_config.num_hidden_layers
    assert len(cache.tensors) == (2 * layers if arch == "llama" else layers)
    assert cache.num_blocks == NUM_BLOCKS
    assert cache.block_bytes == runner.kv_bytes_per_token * BLOCK_SIZE
    torch.manual_seed(1)
    for t in cache.tensors:
        t.copy_(torch.randn_like(t))
    original = [t.clone() for t in cache.tensors]
    payloads = cache.read_blocks([2, 6])
    zero_blocks(cache, [2, 6])
    cache.write_blocks([2, 6], payloads)
    assert all(torch.equal(t, b) for t, b in zip(cache.tensors, original, strict=True))


Tamper = Callable[[PagedKVCache, list[int]], None]


def generate(
    model_dir: Path, tamper: Tamper | None, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy generation of a 4.5-block prompt; after the prefill step (the prompt's KV is then
    in the cache, and the first decode step reads it back from there) `tamper` gets the cache
    and the prompt's blocks. Returns the generated tokens and every later step's logits."""
    engine = Engine(
        EngineConfig(model=str(model_dir), device=DEVICE, dtype=DTYPE, block_size=8, num_kv_blocks=32)
    )
    rng = random.Random(0)
    tokens = [rng.randrange(3, 500) for _ in range(36)]
    seq = engine.add(
        WorkerRequest(
            request_id="a",
            token_ids=tokens,
            max_tokens=6,
            ignore_eos=True,
            sampling=SamplingOptions(temperature=0.0),
        )
    )
    engine.step()
    assert seq.num_computed_tokens == len(tokens)  # the whole prompt in one step
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    if tamper is not None:
        tamper(runner.kv_cache, seq.block_table[: -(-len(tokens) // 8)])
    logits: list[torch.Tensor] = []
    execute = runner.execute

    def recording(out: SchedulerOutput) -> torch.Tensor:
        logits.append(execute(out))
        return logits[-1]

    monkeypatch.setattr(runner, "execute", recording)
    while engine.has_unfinished():
        engine.step()
    return seq.token_ids[len(tokens) :], logits


def offload_and_load(cache: PagedKVCache, block_ids: list[int]) -> None:
    payloads = cache.read_blocks(block_ids)
    zero_blocks(cache, block_ids)
    cache.write_blocks(block_ids, payloads)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_restored_blocks_give_identical_generation(
    arch: str, tiny_llama_dir: Path, tiny_deepseek_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_llama_dir if arch == "llama" else tiny_deepseek_dir
    tokens, logits = generate(model_dir, None, monkeypatch)
    restored_tokens, restored_logits = generate(model_dir, offload_and_load, monkeypatch)
    _, zeroed_logits = generate(model_dir, zero_blocks, monkeypatch)
    assert len(tokens) == 6 and len(logits) == 5
    assert restored_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(restored_logits, logits, strict=True))
    # The negative control: the zeroed prompt is what the next step reads, so it must show.
    assert not torch.allclose(zeroed_logits[0], logits[0])
