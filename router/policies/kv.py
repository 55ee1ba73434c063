"""KV-aware routing: send a request where its prompt is cached, unless that worker is loaded.

For each candidate the index gives the cached prefix length; `router.cost` turns it and the
worker's active blocks into a cost and picks one. Workers above the busy thresholds are left
out unless all are busy (then the request queues on the cheapest rather than failing).
The index is either the event-fed `KvIndexer` or, for engines without KV events, the
`ApproxIndexer` that learns from these decisions via `on_routed`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Protocol

from router.block_index import Matches
from router.cost import CostParams, available, cached_blocks, choose, costs
from router.protocols import Decision, RouteRequest, WorkerLoad


class OverlapIndex(Protocol):
    def find_matches(self, hashes: Sequence[int]) -> Matches: ...

    def on_routed(self, worker_id: str, hashes: Sequence[int]) -> None: ...


class KvPolicy:
    def __init__(
        self, index: OverlapIndex, block_size: int, params: CostParams, seed: int | None = None
    ) -> None:
        self.index = index
        self.block_size = block_size
        self.params = params
        self._rng = random.Random(seed)

    def select(self, request: RouteRequest, workers: Mapping[str, WorkerLoad]) -> Decision:
        matches = self.index.find_matches(request.block_hashes)
        params = self.params
        workers = available(workers, params)
        pool = list(workers)
        active = [load.blocks for load in workers.values()]
        # Only the few workers holding part of the prompt get a hit term; pool.index is a
        # C-level scan, cheaper than mapping every worker to its position per decision.
        hits, lower = matches.blocks, matches.lower
        cached = {
            pool.index(w): cached_blocks(n, lower[w], params) if w in lower else n
            for w, n in hits.items()
            if w in workers
        }
        worker_costs = costs(request.num_tokens / self.block_size, cached, active, params)
        index = choose(worker_costs, active, params.temperature, self._rng)
        chosen = pool[index]
        self.index.on_routed(chosen, request.block_hashes)
        return Decision(
            worker_id=chosen,
            overlap_blocks=hits.get(chosen, 0),
            cost=worker_costs[index],
            best_overlap_blocks=max(hits.values(), default=0),
        )
