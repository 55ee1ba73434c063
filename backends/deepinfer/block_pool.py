"""The device's KV blocks: reference counts, free lists, and which hash each cached block holds.

Blocks are integer ids; only the model runner maps them to KV memory, so nothing here touches
torch. Free blocks are handed out uncached ones first (a stack), then cached ones least
recently freed first: a cached block whose last user leaves stays findable by its hash until
a fresh block is needed and no uncached one is left. What a hit or an eviction means (events,
lower tiers) is the KV cache manager's business (kv_cache_manager.py).
"""

from __future__ import annotations

from collections import OrderedDict


class Block:
    __slots__ = ("block_id", "ref_count", "seq_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.seq_hash: int | None = None  # set while the block is in the prefix cache


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: dict[int, Block] = {}  # seq_hash -> the block holding it
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, Block] = OrderedDict()
        self.num_active_blocks = 0  # blocks with ref_count > 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    def ref(self, block: Block) -> None:
        """One more user of a block (a prefix hit): a free one leaves the free list."""
        if block.ref_count == 0:
            del self._free_cached[block.block_id]  # a cached block with no user is always there
            self.num_active_blocks += 1
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.num_active_blocks -= 1
            if block.seq_hash is None:
                self._free_uncached.append(block_id)
            else:
                self._free_cached[block_id] = block

    def take_free(self) -> tuple[Block, int | None]:
        """A free block for one user, and the hash it was evicted from (None if uncached)."""
        evicted: int | None = None
        if self._free_uncached:
            block = self.blocks[self._free_uncached.pop()]
        else:
            _, block = self._free_cached.popitem(last=False)
            evicted = block.seq_hash
            assert evicted is not None
            del self.cached[evicted]
            block.seq_hash = None
        block.ref_count = 1
        self.num_active_blocks += 1
        return block, evicted

    def cache(self, block: Block, seq_hash: int) -> None:
        block.seq_hash = seq_hash
        self.cached[seq_hash] = block

    def clear(self) -> None:
        """Forget every cached hash (blocks in use stay allocated, just uncached)."""
        for block in self.cached.values():
            block.seq_hash = None
        self._free_uncached.extend(self._free_cached)
        self._free_cached.clear()
        self.cached.clear()
