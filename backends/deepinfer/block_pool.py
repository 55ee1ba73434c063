"""The device's KV blocks: reference counts, free lists, and which hash each cached block holds.

Blocks are integer ids; only the model runner maps them to KV memory, so nothing here touches
torch. Free blocks are handed out uncached ones first (a stack), then cached ones least
recently freed first: a cached block whose last user leaves stays findable by its hash until
a fresh block is needed and no uncached one is left. What a hit or an eviction means (events,
lower tiers) is the KV cache manager's business (kv_cache_manager.py).

Eviction is LRU, as in vLLM, or segmented LRU (`slru`; Karedla et al., 1994):
a cached block that a prefix hit reuses becomes protected, and free protected blocks are
evicted only once no unprotected one is left, so a stream of prompts seen once cannot flush
the prefixes that are shared. At most `PROTECTED_SHARE` of the blocks are protected; past
that, the least recently freed protected block goes back to the unprotected ones.

Or adaptively (`arc`), as ARC does (Megiddo and Modha, 2003), with nothing to choose: the two
segments stay, with no fixed share. The pool remembers the hashes of the blocks it evicted
from each segment (as many as it has blocks, per segment). A block computed or loaded again
whose hash was evicted from the unprotected segment shows that segment was too small, and
moves the target size of the unprotected segment up; one evicted from the protected segment
moves it down; either way the block enters the protected segment. A free protected block is
evicted first while the unprotected segment is within its target.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Literal, get_args

Eviction = Literal["lru", "slru", "arc"]
EVICTIONS: tuple[str, ...] = get_args(Eviction)
# Segmented LRU's protected share: the usual 80 % (as in Caffeine's W-TinyLFU main space),
# not fitted to any trace.
PROTECTED_SHARE = 0.8


def check_eviction(value: str) -> None:
    """ValueError unless `value` names an eviction policy (a config's `kv_eviction`)."""
    if value not in EVICTIONS:
        raise ValueError(f"kv_eviction must be one of {', '.join(EVICTIONS)}, got {value!r}")


class Block:
    __slots__ = ("block_id", "protected", "ref_count", "seq_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.seq_hash: int | None = None  # set while the block is in the prefix cache
        self.protected = False  # reused since it was cached (segmented LRU)


class BlockPool:
    def __init__(self, num_blocks: int, eviction: Eviction = "lru") -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        check_eviction(eviction)
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: dict[int, Block] = {}  # seq_hash -> the block holding it
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, Block] = OrderedDict()  # unprotected, evicted first
        self._free_protected: OrderedDict[int, Block] = OrderedDict()
        limits = {"lru": 0, "slru": int(num_blocks * PROTECTED_SHARE), "arc": num_blocks}
        self._protected_limit = limits[eviction]
        self._num_protected = 0
        self._adaptive = eviction == "arc"
        # ARC's ghosts: hashes evicted from the unprotected and from the protected segment.
        self._evicted_unprotected: OrderedDict[int, None] = OrderedDict()
        self._evicted_protected: OrderedDict[int, None] = OrderedDict()
        self._unprotected_target = 0.0  # ARC's p: the unprotected segment's target size
        self.num_active_blocks = 0  # blocks with ref_count > 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached) + len(self._free_protected)

    def ref(self, block: Block) -> None:
        """One more user of a block: a free one leaves the free list."""
        if block.ref_count == 0:
            # A cached block with no user is always on one of the two lists.
            del (self._free_protected if block.protected else self._free_cached)[block.block_id]
            self.num_active_blocks += 1
        block.ref_count += 1

    def reused(self, block: Block) -> None:
        """A prefix hit on a cached block (after `ref`): under segmented LRU it is protected."""
        if block.protected or not self._protected_limit:
            return
        block.protected = True
        self._num_protected += 1
        while self._num_protected > self._protected_limit and self._free_protected:
            _, demoted = self._free_protected.popitem(last=False)
            self._unprotect(demoted)
            self._free_cached[demoted.block_id] = demoted  # the most recent of the unprotected

    def release_many(self, block_ids: Iterable[int]) -> None:
        """One user fewer for each block, in turn: a block with none left is free (the later
        ones more recently freed)."""
        blocks = self.blocks
        for block_id in block_ids:
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count:
                continue
            self.num_active_blocks -= 1
            if block.seq_hash is None:
                self._free_uncached.append(block_id)
            elif block.protected and self._num_protected <= self._protected_limit:
                self._free_protected[block_id] = block
            else:  # unprotected, or protected while the protected share was full
                if block.protected:
                    self._unprotect(block)
                self._free_cached[block_id] = block

    def take_free_many(self, n: int, evicted: list[int]) -> list[int]:
        """The ids of `n` free blocks for one user each (the caller checked there are):
        uncached ones first, then the least recently freed cached ones, whose hashes leave
        the prefix cache and are appended to `evicted`."""
        uncached = self._free_uncached
        taken = [uncached.pop() for _ in range(min(n, len(uncached)))]
        for _ in range(n - len(taken)):
            block = self._victim()
            seq_hash = block.seq_hash
            assert seq_hash is not None
            del self.cached[seq_hash]
            evicted.append(seq_hash)
            block.seq_hash = None
            if self._adaptive:
                ghosts = self._evicted_protected if block.protected else self._evicted_unprotected
                ghosts[seq_hash] = None
                if len(ghosts) > self.num_blocks:
                    ghosts.popitem(last=False)
            if block.protected:
                self._unprotect(block)
            taken.append(block.block_id)
        blocks = self.blocks
        for block_id in taken:
            blocks[block_id].ref_count = 1
        self.num_active_blocks += n
        return taken

    def _victim(self) -> Block:
        """The free cached block to evict: the least recently freed unprotected one, unless
        (adaptively) the unprotected segment is within its target and a protected one is free."""
        unprotected, protected = self._free_cached, self._free_protected
        if (
            self._adaptive
            and protected
            and (not unprotected or len(self.cached) - self._num_protected <= self._unprotected_target)
        ):
            return protected.popitem(last=False)[1]
        return (unprotected or protected).popitem(last=False)[1]

    def _unprotect(self, block: Block) -> None:
        block.protected = False
        self._num_protected -= 1

    def cache(self, block: Block, seq_hash: int) -> None:
        """`block` (in use) now holds `seq_hash`'s KV."""
        block.seq_hash = seq_hash
        self.cached[seq_hash] = block
        if self._adaptive:
            self._readmit(block, seq_hash)

    def _readmit(self, block: Block, seq_hash: int) -> None:
        """ARC's adaptation: a hash this pool evicted is back, so the segment it was evicted
        from was too small. The step is 1, or larger while that segment's ghosts are the fewer."""
        recent, frequent = self._evicted_unprotected, self._evicted_protected
        if seq_hash in recent:
            step = max(len(frequent) / len(recent), 1.0)
            self._unprotected_target = min(float(self.num_blocks), self._unprotected_target + step)
            del recent[seq_hash]
        elif seq_hash in frequent:
            step = max(len(recent) / len(frequent), 1.0)
            self._unprotected_target = max(0.0, self._unprotected_target - step)
            del frequent[seq_hash]
        else:
            return
        block.protected = True
        self._num_protected += 1

    def clear(self) -> None:
        """Forget every cached hash (blocks in use stay allocated, just uncached)."""
        for block in self.cached.values():
            block.seq_hash = None
            block.protected = False
        self._free_uncached.extend(self._free_cached)
        self._free_uncached.extend(self._free_protected)
        self._free_cached.clear()
        self._free_protected.clear()
        self._num_protected = 0
        self.cached.clear()
        self._evicted_unprotected.clear()
        self._evicted_protected.clear()
        self._unprotected_target = 0.0
