"""Routing by predicted time to first token (Mooncake's conductor, FAST'25, for one pool).

For each candidate worker the predicted TTFT of this request is the time the worker needs to
compute the prefill queued ahead of it and then this prompt's uncached part, in steps of the
engine's token budget, each beside a decode step while the worker has sequences running:

    ttft(w) = prefill_wait(queued_prefill_tokens(w) + uncached_tokens(w))

with `router.step_time.StepTime`, the model the mocker simulates steps with. The cached part
is read from the same index and tier credits as the `kv` policy (a lower-tier hit still
costs a share of its prefill). The worker whose TTFT is lowest takes the request; ties go to
the one decoding fewer blocks. The decode slowdown the prefill causes the worker's running
sequences is not weighed: as a penalty it moved the shared trace's mean TTFT by -0.3 % with
LRU eviction and +1.5 % with `arc`, and its TPOT not at all (docs/router.md).

The step model's constants are the engine's (Dynamo's mocker polynomial by default, or a
fitted one), never tuned to a workload: the policy has no weight of its own to tune.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from router.cost import CostParams, available, cached_blocks, choose
from router.policies.kv import OverlapIndex
from router.protocols import Decision, RouteRequest, WorkerLoad
from router.step_time import StepTime


class TtftPolicy:
    def __init__(
        self,
        index: OverlapIndex,
        block_size: int,
        params: CostParams,
        step_time: StepTime | None = None,
        step_tokens: int = 8192,
        seed: int | None = None,
    ) -> None:
        self.index = index
        self.block_size = block_size
        self.params = params
        self.step_time = step_time or StepTime()
        self.step_tokens = step_tokens
        self._rng = random.Random(seed)

    def predicted_ttft_ms(self, uncached_tokens: float, load: WorkerLoad) -> float:
        """This worker's predicted TTFT for a prompt of `uncached_tokens` still to compute."""
        tokens = load.prefill_tokens + max(round(uncached_tokens), 0)
        step_time = load.step_time or self.step_time
        return step_time.prefill_wait_ms(tokens, self.step_tokens, load.requests > 0, load.kv_usage)

    def select(self, request: RouteRequest, workers: Mapping[str, WorkerLoad]) -> Decision:
        matches = self.index.find_matches(request.block_hashes)
        workers = available(workers, self.params)
        hits, lower = matches.blocks, matches.lower
        pool = list(workers)
        predicted: list[float] = []
        for worker_id, load in workers.items():
            n = hits.get(worker_id, 0)
            cached = cached_blocks(n, lower[worker_id], self.params) if worker_id in lower else n
            uncached = request.num_tokens - cached * self.block_size
            predicted.append(self.predicted_ttft_ms(uncached, load))
        active: Sequence[int] = [load.blocks for load in workers.values()]
        index = choose(predicted, active, 0.0, self._rng)
        chosen = pool[index]
        self.index.on_routed(chosen, request.block_hashes)
        return Decision(
            worker_id=chosen,
            overlap_blocks=hits.get(chosen, 0),
            cost=predicted[index],
            best_overlap_blocks=max(hits.values(), default=0),
        )
