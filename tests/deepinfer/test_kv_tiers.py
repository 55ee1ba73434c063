"""DeepInfer with KV tiers (kvbm), on a real tiny Llama: a prefix evicted from the engine's
own cache comes back from host memory, disk or a shared Redis, reported as cached tokens and
giving token-identical greedy output; a damaged block is recomputed, never served."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from backends.deepinfer.engine import Engine
from backends.deepinfer.outputs import SeqOutput
from backends.deepinfer.sequence import SequenceStatus
from kvbm import metrics
from kvbm.disk import DiskStore
from kvbm.redis_store import RedisStore
from tests.deepinfer.test_engine import make_engine, prompt, request, run
from tests.servers import redis_server

BLOCK = 16
# 8 device blocks: one 64-token prompt and its output fill half, so two other prompts evict it.
DEVICE_BLOCKS = 8


def _engine(model_dir: Path, **tiers: Any) -> Engine:
    return make_engine(model_dir, block_size=BLOCK, num_kv_blocks=DEVICE_BLOCKS, **tiers)


def _block_gb(engine: Engine, blocks: int) -> float:
    return blocks * engine.runner.kv_cache.block_bytes / 2**30


def _evict(engine: Engine, rng: random.Random) -> None:
    """Two unrelated prompts, each as long as the device cache allows: the first prompt's
    blocks leave the device."""
    run(engine, [request("evict-1", prompt(rng, 64))])
    run(engine, [request("evict-2", prompt(rng, 64))])


def _finish(engine: Engine) -> dict[str, SeqOutput]:
    final: dict[str, SeqOutput] = {}
    while engine.has_unfinished():
        final |= {o.seq.request_id: o for o in engine.step() if o.finished}
    return final


def _onboarded(engine: Engine, tier: str) -> float:
    assert engine.tiers is not None
    return metrics.ONBOARD_BLOCKS.labels(engine.tiers.worker, tier)._value.get()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[str, Any]:
    """The same prompt on an engine without tiers: what every tiered run must reproduce, and
    proof that the eviction really empties the device cache (no cached tokens the second time)."""
    engine = _engine(tiny_llama_dir)
    rng = random.Random(7)
    tokens = prompt(rng, 64)
    first = run(engine, [request("a", tokens)])["a"]
    _evict(engine, rng)
    again = run(engine, [request("a2", tokens)])["a2"]
    assert again.seq.num_cached_tokens == 0
    assert again.seq.token_ids == first.seq.token_ids
    return {"tokens": tokens, "output": first.seq.token_ids}


def test_an_evicted_prefix_comes_back_from_host_memory(
    tiny_llama_dir: Path, reference: dict[str, Any]
) -> None:
    probe = _engine(tiny_llama_dir)
    engine = _engine(tiny_llama_dir, host_cache_gb=_block_gb(probe, 64))
    rng = random.Random(7)
    tokens = reference["tokens"]
    assert tokens == prompt(rng, 64)
    run(engine, [request("a", tokens)])
    _evict(engine, rng)
    before = _onboarded(engine, "host")
    again = run(engine, [request("a2", tokens)])["a2"]
    assert again.seq.num_cached_tokens == 48  # three full blocks; the last token is computed
    assert _onboarded(engine, "host") - before == 3
    assert again.seq.token_ids == reference["output"]


def test_disk_serves_what_host_memory_dropped_and_a_flipped_byte_is_recomputed(
    tiny_llama_dir: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    probe = _engine(tiny_llama_dir)
    tiers = {
        "host_cache_gb": _block_gb(probe, 2),  # host keeps two blocks: the rest falls to disk
        "disk_cache_dir": str(tmp_path),
        "disk_cache_gb": _block_gb(probe, 64) * 1.1,
        "disk_cache_min_reuse": 0,  # every block host memory drops goes to disk
    }
    engine = _engine(tiny_llama_dir, **tiers)
    rng = random.Random(7)
    tokens = prompt(rng, 64)
    run(engine, [request("a", tokens)])
    _evict(engine, rng)
    before = _onboarded(engine, "disk")
    # The disk is read on the tiers' transfer thread: the first step only starts the read and
    # sets the sequence aside, computing nothing for it.
    seq = engine.add(request("a2", tokens))
    assert engine.step() == [] and seq.status is SequenceStatus.LOADING_KV
    final = _finish(engine)["a2"]
    assert final.seq.num_cached_tokens == 48
    assert _onboarded(engine, "disk") - before >= 1
    assert final.seq.token_ids == reference["output"]

    # Damage every block on disk (one byte in each slot's payload), push the prompt out of the
    # device and host memory again, and ask once more: nothing damaged is served.
    assert engine.tiers is not None and isinstance(engine.tiers.disk, DiskStore)
    slab, slot_bytes = engine.tiers.disk.path, engine.tiers.disk.slot_bytes
    data = bytearray(slab.read_bytes())
    for slot in range(len(data) // slot_bytes):
        data[slot * slot_bytes + slot_bytes // 2] ^= 0xFF
    slab.write_bytes(bytes(data))
    _evict(engine, rng)
    errors = metrics.ERRORS.labels(engine.tiers.worker, "disk")._value.get()
    last = run(engine, [request("a3", tokens)])["a3"]
    assert last.seq.token_ids == reference["output"]
    assert metrics.ERRORS.labels(engine.tiers.worker, "disk")._value.get() > errors
    assert last.seq.num_cached_tokens < 48


def test_two_workers_share_blocks_through_redis(
    tiny_llama_dir: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    with redis_server(tmp_path) as url:
        probe = _engine(tiny_llama_dir)
        tiers = {"host_cache_gb": _block_gb(probe, 64), "redis_url": url}
        worker_a, worker_b = _engine(tiny_llama_dir, **tiers), _engine(tiny_llama_dir, **tiers)
        tokens = reference["tokens"]
        run(worker_a, [request("a", tokens)])
        before = _onboarded(worker_b, "remote")
        served = run(worker_b, [request("b", tokens)])["b"]  # B never saw the prompt
        assert served.seq.num_cached_tokens == 48
        assert _onboarded(worker_b, "remote") - before == 3
        assert _onboarded(worker_a, "remote") == 0  # each engine's series are its own
        assert served.seq.token_ids == reference["output"]


def test_a_redis_that_goes_away_is_a_miss_not_a_failure(
    tiny_llama_dir: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    probe = _engine(tiny_llama_dir)
    with redis_server(tmp_path) as url:
        tiers = {"host_cache_gb": _block_gb(probe, 64), "redis_url": url}
        worker_a, worker_b = _engine(tiny_llama_dir, **tiers), _engine(tiny_llama_dir, **tiers)
        run(worker_a, [request("a", reference["tokens"])])
    # Redis is gone (stopped with the block above): B computes the prompt itself.
    served = run(worker_b, [request("b", reference["tokens"])])["b"]
    assert served.seq.num_cached_tokens == 0
    assert served.seq.token_ids == reference["output"]
    assert worker_b.tiers is not None and isinstance(worker_b.tiers.remote, RedisStore)
    assert not worker_b.tiers.remote.available
