"""Onboarding throughput: `PagedKVCache.write_blocks` (what a prefix hit on a KV tier costs the
cache) against the raw copy of the same bytes, in one process.

The cache has SmolLM2-135M's layout (30 layers of K and V, 16-token blocks of 3 KV heads x 64,
in bfloat16: 368,640 bytes a block); each write is 512 blocks (189 MB) from separate payloads,
as the tiers hand them over. On CUDA the raw limits are one copy of the same bytes from pinned
and from pageable host memory, and the write is measured again from views of pinned slots, as
a GPU engine's host tier hands blocks over (`write_from_pinned_store_gbps`); on the CPU, one
memcpy of them. Best of 5.

Offloading, the other way, is measured into the same kind of slots: `read_blocks` then a copy
of each payload into its slot, as the offload did before (`offload_read_then_put_gbps`),
against `read_blocks_into` the slots directly (`offload_into_slots_gbps`), as it does now.

    python benchmarks/kv_cache_write.py                 # cuda when torch sees a GPU, else cpu
    python benchmarks/kv_cache_write.py --device cpu

Ends with one JSON line: each rate in GB/s, `identical` (the blocks read back equal the
payloads) and `of_raw`, the write's rate over the best raw copy's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.deepinfer.kv_cache import PagedKVCache

LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, WRITE_BLOCKS = 30, 1024, 16, 3, 64, 512


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(1)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    tensors = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(2 * LAYERS)]
    cache = PagedKVCache(tensors, [2] * LAYERS)
    rng = np.random.default_rng(0)
    payloads = [
        rng.integers(0, 256, cache.block_bytes, dtype=np.uint8).tobytes() for _ in range(WRITE_BLOCKS)
    ]
    total = WRITE_BLOCKS * cache.block_bytes
    flat = torch.from_numpy(np.frombuffer(b"".join(payloads), dtype=np.uint8).copy())

    def gbps(copy: Callable[[], object], repeats: int = 5) -> float:
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms up
            started = time.perf_counter()
            copy()
            if cuda:
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - started)
        return round(total / best / 1e9, 2)

    raw: dict[str, float] = {}
    if cuda:
        pinned = flat.pin_memory()
        raw["raw_pinned_gbps"] = gbps(lambda: pinned.to(device, non_blocking=True))
        raw["raw_pageable_gbps"] = gbps(lambda: flat.to(device))
    else:
        target = torch.empty_like(flat)
        raw["raw_memcpy_gbps"] = gbps(lambda: target.copy_(flat))
    block_ids = list(range(100, 100 + WRITE_BLOCKS))
    write = gbps(lambda: cache.write_blocks(block_ids, payloads))
    identical = cache.read_blocks(block_ids) == payloads
    # A host tier's slots (pinned on a GPU): every other slot, as an LRU store's blocks of one
    # prefix seldom sit side by side.
    arena = torch.empty(2 * total, dtype=torch.uint8, pin_memory=cuda)
    slots = memoryview(arena.numpy())
    size = cache.block_bytes
    views = [slots[2 * i * size : (2 * i + 1) * size] for i in range(WRITE_BLOCKS)]

    def read_then_put() -> None:  # the offload before read_blocks_into: bytes, then a copy into the slot
        for view, payload in zip(views, cache.read_blocks(block_ids), strict=True):
            view[:] = payload

    offload = {
        "offload_read_then_put_gbps": gbps(read_then_put),
        "offload_into_slots_gbps": gbps(lambda: cache.read_blocks_into(block_ids, views)),
    }
    offload["offload_speedup"] = round(
        offload["offload_into_slots_gbps"] / offload["offload_read_then_put_gbps"], 2
    )
    identical = identical and [bytes(view) for view in views] == payloads
    from_store: dict[str, float] = {}
    if cuda:
        # As a GPU engine's host tier hands blocks over: views of its pinned slots.
        for view, payload in zip(views, payloads, strict=True):
            view[:] = payload
        cache.write_blocks(block_ids, [bytes(size)] * WRITE_BLOCKS)  # zeroed, to check the next write
        from_slots = gbps(lambda: cache.write_blocks(block_ids, views))
        from_store = {
            "write_from_pinned_store_gbps": from_slots,
            "pinned_store_of_raw": round(from_slots / max(raw.values()), 3),
        }
        identical = identical and cache.read_blocks(block_ids) == payloads
    figures = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "block_bytes": cache.block_bytes,
        "blocks": WRITE_BLOCKS,
        **raw,
        "write_blocks_gbps": write,
        "of_raw": round(write / max(raw.values()), 3),
        **from_store,
        **offload,
        "identical": identical,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
