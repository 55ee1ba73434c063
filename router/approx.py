"""Approximate KV index for engines that publish no KV events.

The router predicts what each worker caches from its own decisions: a request routed to a
worker leaves its prompt blocks there. Predictions expire after `ttl_s` (the engine will
have evicted cold blocks by then) and the oldest go first once `max_blocks` (worker, block)
pairs are held, so the index stays bounded. Routing a block again refreshes its clock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from router.block_index import BlockIndex, Matches


class ApproxIndexer:
    def __init__(
        self,
        ttl_s: float = 120.0,
        max_blocks: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or max_blocks <= 0:
            raise ValueError("ttl_s and max_blocks must be positive")
        self.blocks = BlockIndex()
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        # (worker, seq hash) -> expiry time, oldest first
        self._expiry: OrderedDict[tuple[str, int], float] = OrderedDict()

    def add_worker(self, worker_id: str) -> None:
        self.blocks.add_worker(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        self.blocks.remove_worker(worker_id)
        for key in [k for k in self._expiry if k[0] == worker_id]:
            del self._expiry[key]

    def needs_resync(self) -> list[str]:
        return []

    def find_matches(self, hashes: Sequence[int]) -> Matches:
        self._expire()
        return self.blocks.find_matches(hashes)

    def on_routed(self, worker_id: str, hashes: Sequence[int]) -> None:
        expires = self._clock() + self.ttl_s
        expiry = self._expiry
        for seq_hash in hashes:
            key = (worker_id, seq_hash)
            if key in expiry:
                expiry.move_to_end(key)
            expiry[key] = expires
        self.blocks.store(worker_id, hashes)
        while len(expiry) > self.max_blocks:
            (old_worker, old_hash), _ = expiry.popitem(last=False)
            self.blocks.remove(old_worker, (old_hash,))

    def _expire(self) -> None:
        now = self._clock()
        expiry = self._expiry
        while expiry:
            key, expires = next(iter(expiry.items()))
            if expires > now:
                return
            del expiry[key]
            self.blocks.remove(key[0], (key[1],))

    def __len__(self) -> int:
        return len(self._expiry)
