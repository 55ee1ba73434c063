"""Block-granular byte copies out of and into the paged KV cache, for every layer at once.

A KV block manager that offloads blocks to host memory or disk, and loads them back for a
prefix hit, needs a block's state as plain bytes it can store without knowing about layers,
dtypes or devices (it must not import torch). `PagedKVCache` gives it that: a block's payload
is, for each cache tensor in a fixed order, `tensor[block_id]` viewed as bytes, concatenated.
Every layer's cache has the same `[num_blocks, block_size, ...]` leading dims, so one block id
names the same tokens in all of them.

Copies are batched: reading gathers the requested blocks of each tensor with one
`index_select`, concatenates them on the device and makes one device-to-host copy; writing
assembles the payloads in one host buffer, makes one host-to-device copy and scatters each
tensor's part with one `index_copy_`. Per-block Python work is only slicing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from backends.deepinfer.layers.attention import Attention
from backends.deepinfer.layers.mla import MLAttention

# (dtype name, block_size, each tensor's per-block shape in order): blocks saved under one layout
# can be loaded only into a cache of the same layout.
KVLayout = tuple[str, int, tuple[tuple[int, ...], ...]]


class PagedKVCache:
    """Byte-level access to whole KV blocks of a set of per-layer cache tensors.

    The tensors are referenced, not copied: they must stay the ones the layers write (true
    after `allocate_cache`, which the runner calls once)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("a paged KV cache needs at least one cache tensor")
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
        self._layout: KVLayout = (
            str(first.dtype).removeprefix("torch."),
            first.shape[1],
            tuple(tuple(t.shape[1:]) for t in self._tensors),
        )

    @classmethod
    def from_layers(cls, layers: Iterable[Attention | MLAttention]) -> PagedKVCache:
        """The caches of `layers` (allocated), in layer order: K then V for attention, the
        latent cache for MLA."""
        tensors: list[torch.Tensor] = []
        for layer in layers:
            if isinstance(layer, Attention):
                tensors.extend((layer.k_cache, layer.v_cache))
            else:
                tensors.append(layer.kv_cache)
        return cls(tensors)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The cache tensors in payload order."""
        return self._tensors

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
        index = self._index(block_ids)
        n = len(block_ids)
        rows = [t.index_select(0, index).view(n, -1).view(torch.uint8) for t in self._tensors]
        host = torch.cat(rows, dim=1).cpu().numpy()  # [n, block_bytes], the one device -> host copy
        return [host[i].tobytes() for i in range(n)]

    @torch.no_grad()
    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Overwrite each block in `block_ids` with its payload (as `read_blocks` returned it).

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
        if not block_ids:
            return
        index = self._index(block_ids)
        n, size = len(block_ids), self._block_bytes
        buffer = bytearray(n * size)  # writable, so torch.frombuffer shares it without a copy
        view = memoryview(buffer)
        for i, payload in enumerate(payloads):
            view[i * size : (i + 1) * size] = payload
        data = torch.frombuffer(buffer, dtype=torch.uint8).view(n, size).to(index.device)
        for t, offset, nbytes in zip(self._tensors, self._offsets, self._sizes, strict=True):
            part = data[:, offset : offset + nbytes].view(t.dtype).view(n, *t.shape[1:])
            t.index_copy_(0, index, part)

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} outside 0 .. {self.num_blocks - 1}")
        return torch.tensor(block_ids, dtype=torch.long).to(self._tensors[0].device)
