"""The KV tiers a DeepInfer engine was configured with, sized in blocks of its own cache.

Blocks are keyed by a layout id made of the served model's name and the cache's layout
(dtype, block size, every layer's per-block shape), so two workers of one model share G4
blocks and a worker of another model, or of the same model in another dtype, never loads them.
The tiers' metrics are labelled `worker="<served model>-<n>"` (kvbm/metrics.py): the engine
has no worker id yet when it builds them, and n tells apart the engines of one process.
"""

from __future__ import annotations

from pathlib import Path

import torch

from backends.deepinfer.config import EngineConfig
from backends.deepinfer.kv_cache import PagedKVCache
from kvbm import records
from kvbm.disk import DiskStore, slot_bytes
from kvbm.redis_store import RedisStore
from kvbm.stores import HostStore
from kvbm.tiered import TieredStore
from kvbm.transfer import TransferEngine


def kv_layout_id(config: EngineConfig, cache: PagedKVCache) -> int:
    """The id under which this engine's KV blocks are stored and exchanged: equal ids mean a
    block written by one engine can be loaded by the other (tiers, disaggregation)."""
    return records.layout_id(config.served_model_name or Path(config.model).name, cache.layout)


def build_tiers(config: EngineConfig, cache: PagedKVCache) -> TieredStore | None:
    if not config.host_cache_gb:
        return None
    block_bytes = cache.block_bytes
    name = config.served_model_name or Path(config.model).name
    layout = kv_layout_id(config, cache)
    host_blocks = int(config.host_cache_gb * 2**30) // block_bytes
    if host_blocks < 1:
        raise ValueError(f"host_cache_gb={config.host_cache_gb} holds no KV block of {block_bytes} bytes")
    disk = None
    if config.disk_cache_dir:
        disk_blocks = int(config.disk_cache_gb * 2**30) // slot_bytes(block_bytes)
        if disk_blocks < 1:
            raise ValueError(f"disk_cache_gb={config.disk_cache_gb} holds no KV block of {block_bytes} bytes")
        disk = DiskStore(Path(config.disk_cache_dir), disk_blocks, block_bytes, layout)
    remote = RedisStore(config.redis_url, layout, block_bytes) if config.redis_url else None
    # On a GPU the slots are pinned: an onboarding copies each block from its slot to the device
    # directly (PagedKVCache), with no pass through a staging buffer.
    arena = None
    device = cache.tensors[0].device
    if device.type == "cuda":
        pinned = torch.empty(host_blocks * block_bytes, dtype=torch.uint8, pin_memory=True)
        arena = pinned.numpy().data  # a view whose array keeps the tensor alive
    host = HostStore(host_blocks, block_bytes, buffer=arena)
    # Disk and network I/O off the step thread; host memory alone needs no thread.
    transfer = TransferEngine() if disk is not None or remote is not None else None
    return TieredStore(
        host,
        disk=disk,
        remote=remote,
        disk_min_reuse=config.disk_cache_min_reuse,
        transfer=transfer,
        name=name,
        worker_id=config.worker_id,
    )
