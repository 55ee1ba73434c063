"""Block-granular byte copies out of and into the paged KV cache, for every layer at once.

A KV block manager that offloads blocks to host memory or disk, and loads them back for a
prefix hit, needs a block's state as plain bytes it can store without knowing about layers,
dtypes or devices (it must not import torch). `PagedKVCache` gives it that: a block's payload
is, for each cache tensor in a fixed order, `tensor[block_id]` viewed as bytes, concatenated.
Every layer's cache has the same `[num_blocks, block_size, ...]` leading dims, so one block id
names the same tokens in all of them.

Copies are batched: reading gathers the requested blocks of each tensor with one
`index_select`, concatenates them on the device and makes one device-to-host copy; writing
assembles the payloads in one host buffer and scatters each tensor's part with one
`index_copy_`, a layer at a time on a loader thread, so that the forward pass can start
before the last layer's blocks are in (`kv_arrival`). Per-block Python work is only slicing.

On CUDA the host buffer is pinned (page-locked) and takes whole payloads; one copy moves them
to the device, where the GPU scatters each tensor's part, all on a stream of the loader's own
whose events the forward's stream waits on, layer by layer (`kv_arrival`). That stream first
waits for what the compute stream had queued when the write started: the blocks written may
have been freed by a step whose kernels are still running.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import accumulate

import numpy as np
import torch

from backends.deepinfer.kv_arrival import KVArrival
from backends.deepinfer.layers.attention import Attention
from backends.deepinfer.layers.mla import MLAttention
from kvbm.records import Payload

# (dtype name, block_size, each tensor's per-block shape in order): blocks saved under one layout
# can be loaded only into a cache of the same layout.
KVLayout = tuple[str, int, tuple[tuple[int, ...], ...]]

# How much of a CPU cache `read_blocks_into` gathers at a time (it keeps a buffer this size).
GATHER_CHUNK_BYTES = 8 << 20


class PagedKVCache:
    """Byte-level access to whole KV blocks of a set of per-layer cache tensors.

    The tensors are referenced, not copied: they must stay the ones the layers write (true
    after `allocate_cache`, which the runner calls once)."""

    def __init__(
        self, tensors: Sequence[torch.Tensor], tensors_per_layer: Sequence[int] | None = None
    ) -> None:
        """`tensors_per_layer`: how many consecutive tensors each cache layer owns (2 for K and V,
        1 for an MLA latent); by default each tensor is a layer of its own."""
        if not tensors:
            raise ValueError("a paged KV cache needs at least one cache tensor")
        per_layer = [1] * len(tensors) if tensors_per_layer is None else list(tensors_per_layer)
        if sum(per_layer) != len(tensors) or min(per_layer) < 1:
            raise ValueError(f"layers of {per_layer} tensors do not partition {len(tensors)} tensors")
        first = tensors[0]
        for t in tensors:
            if t.dim() < 2 or t.shape[:2] != first.shape[:2]:
                raise ValueError(
                    f"cache tensors disagree on [num_blocks, block_size]: {tuple(t.shape)} vs"
                    f" {tuple(first.shape)}"
                )
            if t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"cache tensors mix {t.dtype}/{t.device} with {first.dtype}/{first.device}")
            if not t.is_contiguous():
                raise ValueError("cache tensors must be contiguous to be viewed as bytes")
        self._tensors = tuple(tensors)
        # Bytes of one block of each tensor, and where each starts within a block's payload.
        self._sizes = [math.prod(t.shape[1:]) * t.element_size() for t in self._tensors]
        self._offsets = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        self._block_bytes = sum(self._sizes)
        self._layer_ends = list(accumulate(per_layer))  # layer i owns tensors [ends[i-1], ends[i])
        self._loader: ThreadPoolExecutor | None = None  # started by the first write
        # The loader's host buffer (its thread's alone), pinned on CUDA, and its side stream there.
        self._device = first.device
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._gathered = torch.empty(0, 0, dtype=torch.uint8)  # read_blocks_into's, on the CPU
        self._copied: torch.cuda.Event | None = None  # the last copy out of the staging buffer
        self._layout: KVLayout = (
            str(first.dtype).removeprefix("torch."),
            first.shape[1],
            tuple(tuple(t.shape[1:]) for t in self._tensors),
        )

    @classmethod
    def from_layers(cls, layers: Iterable[Attention | MLAttention], num_blocks: int) -> PagedKVCache:
        """The first `num_blocks` blocks of the caches of `layers` (allocated; the runner's have
        a scratch block past them), in layer order: K then V for attention, the latent cache
        for MLA."""
        tensors: list[torch.Tensor] = []
        per_layer: list[int] = []
        for layer in layers:
            own = (layer.k_cache, layer.v_cache) if isinstance(layer, Attention) else (layer.kv_cache,)
            tensors.extend(t.narrow(0, 0, num_blocks) for t in own)
            per_layer.append(len(own))
        return cls(tensors, per_layer)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The cache tensors in payload order."""
        return self._tensors

    @property
    def num_layers(self) -> int:
        return len(self._layer_ends)

    @property
    def num_blocks(self) -> int:
        return self._tensors[0].shape[0]

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block across all layers."""
        return self._block_bytes

    @property
    def layout(self) -> KVLayout:
        """What a payload's bytes mean; equal layouts are required to load saved blocks."""
        return self._layout

    @torch.no_grad()
    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """The payload of each block in `block_ids`, in that order."""
        if not block_ids:
            return []
        host = self._gather(block_ids).cpu().numpy()  # the one device -> host copy
        return [row.tobytes() for row in host]

    def read_blocks_into(self, block_ids: list[int], out: Sequence[memoryview]) -> None:
        """Write the payload of each block in `block_ids` into the writable memory `out` gives
        for it: a host tier's slots, pinned on a GPU, so that each block crosses the link once
        and lands where it stays, with no pageable buffer and no host copies between. One
        thread at a time (the engine's step thread): on the CPU it uses a buffer of its own."""
        if len(block_ids) != len(out):
            raise ValueError(f"{len(block_ids)} block ids for {len(out)} destinations")
        if self._device.type != "cpu":
            # The device's caching allocator hands over memory with no pages to fault in.
            for row, memory in zip(self._gather(block_ids), out, strict=True):
                torch.frombuffer(memory, dtype=torch.uint8).copy_(row)
            return
        # A fresh buffer for every block spent more time faulting its pages in than copying
        # into them: 512 of SmolLM2's blocks went out at 0.96 GB/s that way (with the copies
        # of `read_blocks` and a store's `put`), at 9.9 through a buffer of the cache's own, a
        # few megabytes at a time (benchmarks/kv_cache_write.py, on the 2-core machine).
        per_chunk = max(1, GATHER_CHUNK_BYTES // self._block_bytes)
        if self._gathered.shape[0] < min(per_chunk, len(block_ids)):
            self._gathered = torch.empty(per_chunk, self._block_bytes, dtype=torch.uint8)
        for start in range(0, len(block_ids), per_chunk):
            chunk = block_ids[start : start + per_chunk]
            rows = self._gather(chunk, self._gathered[: len(chunk)]).numpy()
            for row, memory in zip(rows, out[start : start + per_chunk], strict=True):
                memory[:] = row

    def _gather(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks' payloads `[n, block_bytes]` (uint8) on the cache's device, in `out` if given."""
        index = self._index(block_ids)
        if out is None:
            out = torch.empty(len(block_ids), self._block_bytes, dtype=torch.uint8, device=self._device)
        for t, offset, size in zip(self._tensors, self._offsets, self._sizes, strict=True):
            # Each tensor's rows straight into their columns (a `torch.cat` of gathered rows
            # would copy every byte once more).
            torch.index_select(
                t.view(t.shape[0], -1).view(torch.uint8), 0, index, out=out[:, offset : offset + size]
            )
        return out

    def write_blocks(self, block_ids: list[int], payloads: Sequence[Payload]) -> None:
        """Overwrite each block in `block_ids` with its payload (as `read_blocks` returned it)."""
        self.start_write(block_ids, payloads).wait_all()

    def start_write(self, block_ids: list[int], payloads: Sequence[Payload]) -> KVArrival:
        """Start writing `payloads` into `block_ids` on the loader thread, layer by layer; the
        returned `KVArrival` tells when each layer's part is in. The caller must not read or
        reuse those blocks before it says so.

        ValueError, before anything is written, on a payload of the wrong size, a length
        mismatch, an unknown block id or a repeated one (the scatter would be ambiguous)."""
        if len(block_ids) != len(payloads):
            raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"repeated block ids in {block_ids}")
        for block_id, payload in zip(block_ids, payloads, strict=True):
            if len(payload) != self._block_bytes:
                raise ValueError(
                    f"block {block_id}: payload of {len(payload)} bytes, expected {self._block_bytes}"
                    f" for layout {self._layout}"
                )
        index = self._index(block_ids)
        arrival = KVArrival(self.num_layers)
        if not block_ids:
            for layer in range(self.num_layers):
                arrival.mark_written(layer)
            return arrival
        queued = None
        if self._stream is not None:
            queued = torch.cuda.Event()
            queued.record(torch.cuda.current_stream(self._device))
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-kv-loader")
        self._loader.submit(self._write_layers, index, payloads, arrival, queued)
        return arrival

    @torch.no_grad()
    def _write_layers(
        self,
        index: torch.Tensor,
        payloads: Sequence[Payload],
        arrival: KVArrival,
        queued: torch.cuda.Event | None,
    ) -> None:
        try:
            blocks = [np.frombuffer(payload, dtype=np.uint8) for payload in payloads]  # no copies
            if self._stream is None:
                self._write_from_host(index, blocks, arrival)
            else:
                assert queued is not None
                self._write_through_device(index, blocks, arrival, queued, self._stream)
        except BaseException as exc:
            arrival.fail(exc)

    def _write_from_host(self, index: torch.Tensor, blocks: list[np.ndarray], arrival: KVArrival) -> None:
        n, first, block_ids = len(blocks), 0, index.numpy()
        for layer, end in enumerate(self._layer_ends):
            for t, offset, nbytes in zip(
                self._tensors[first:end], self._offsets[first:end], self._sizes[first:end], strict=True
            ):
                # One C-level gather of this tensor's part of every payload, then one scatter of
                # the rows by numpy (with torch's index_copy_ instead, `benchmarks/kv_cache_write.py`
                # wrote 2.5 GB/s, not 3.5); numpy drops the GIL while it copies, so the forward
                # on the other thread runs.
                rows = self._staging_for(n * nbytes)[: n * nbytes].view(n, nbytes).numpy()
                np.stack([block[offset : offset + nbytes] for block in blocks], out=rows)
                t.view(t.shape[0], -1).view(torch.uint8).numpy()[block_ids] = rows
            arrival.mark_written(layer)
            first = end

    def _write_through_device(
        self,
        index: torch.Tensor,
        blocks: list[np.ndarray],
        arrival: KVArrival,
        queued: torch.cuda.Event,
        stream: torch.cuda.Stream,
    ) -> None:
        """Whole payloads to the device, and each tensor's part scattered from there by the GPU:
        gathering each tensor's few KiB of every payload on the host, as the CPU path does,
        wrote 3.6 GB/s on an H200 where the pinned link gave 55 (`benchmarks/kv_cache_write.py`).
        Payloads in pinned memory (the host store's slots on a GPU) are copied from where they
        are; others go through the pinned staging buffer first (6.3 GB/s there), in one copy."""
        n = len(blocks)
        # A read-only payload (bytes) is never pinned: only writable arrays are asked.
        pinned = all(block.flags.writeable and torch.from_numpy(block).is_pinned() for block in blocks)
        with torch.cuda.stream(stream):
            stream.wait_event(queued)
            index.record_stream(stream)
            if pinned:
                # The slots are not reused before these copies are done: every layer of the
                # forward waits for them, and the engine's sampling for the forward, before
                # anything is put back into the store (HostStore.get).
                on_device = torch.empty((n, self._block_bytes), dtype=torch.uint8, device=self._device)
                for row, block in zip(on_device, blocks, strict=True):
                    row.copy_(torch.from_numpy(block), non_blocking=True)
            else:
                rows = self._staging_for(n * self._block_bytes)[: n * self._block_bytes].view(n, -1)
                np.stack(blocks, out=rows.numpy())
                on_device = rows.to(self._device, non_blocking=True)
                self._copied = stream.record_event()
            first = 0
            for layer, end in enumerate(self._layer_ends):
                for t, offset, nbytes in zip(
                    self._tensors[first:end], self._offsets[first:end], self._sizes[first:end], strict=True
                ):
                    part = on_device[:, offset : offset + nbytes].view(t.dtype).view(n, *t.shape[1:])
                    t.index_copy_(0, index, part)
                arrival.mark_written(layer, partial(_wait_for, stream.record_event(), self._device))
                first = end

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        """The loader's host buffer (pinned on CUDA), grown to `nbytes`, once the last copy out
        of it is done: a fresh buffer per load spent more time faulting in its pages than
        copying into them."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._stream is not None)
        return self._staging

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} outside 0 .. {self.num_blocks - 1}")
        return torch.tensor(block_ids, dtype=torch.long).to(self._tensors[0].device)


def _wait_for(event: torch.cuda.Event, device: torch.device) -> None:
    """The calling thread's stream on `device` waits (on the GPU) until `event` has happened."""
    torch.cuda.current_stream(device).wait_event(event)
