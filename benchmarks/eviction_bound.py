"""How many prefix hits a trace allows under each eviction policy, and what they would make of
mean TTFT: one cache as large as the cluster's, fed the trace's prompts in arrival order.

For each request, the leading blocks of its prompt that the cache holds are hits (a prefix
cache cannot use a block after a miss); then every block of the prompt is touched, the
misses inserted, and the policy evicts while the cache is over `--blocks`. Policies:

- `lru`: least recently used first, what DeepInfer's block pool (and vLLM's) does;
- `slru`: segmented LRU (Karedla et al., 1994) with the common 80 % protected segment: a
  block hit again moves to the protected segment, whose least recent blocks fall back to
  the probationary one; the probationary segment is evicted first;
- `arc`: segmented LRU whose split adapts as ARC's (Megiddo and Modha, 2003), as DeepInfer's
  block pool does with `--kv-eviction arc`: the hashes of evicted blocks are remembered per
  segment, one that comes back moves the probationary segment's target towards the segment it
  was evicted from and enters the protected one, and the protected segment is evicted first
  while the probationary one is within its target;
- `lfu`: least frequently used first, least recent among equals (SGLang's `lfu` radix cache
  eviction);
- `min`: Belady's MIN, the block used again farthest in the future, which needs the future:
  the most any policy could keep.

The model leaves out what the engines add: output blocks, blocks pinned by running requests,
and eight caches instead of one. `bound_ttft_mean_ms` is the mean of each request's uncached
prefill alone (`ttft_bound.alone_ms`, the mocker's step model).

    python benchmarks/eviction_bound.py [--trace T] [--blocks 131072]

Ends with one JSON line: per policy the hit rate (cached over prompt tokens) and the bound.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ttft_bound import BLOCK_SIZE, TRACE, alone_ms  # noqa: E402

from backends.mocker.config import MockerConfig  # noqa: E402
from router.replay import TraceRequest, TraceTokens, read_trace  # noqa: E402
from router.step_time import StepTime  # noqa: E402

PROTECTED_SHARE = 0.8


def lru(prompts: list[list[int]], capacity: int) -> list[int]:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = []
    for blocks in prompts:
        hits.append(_leading(blocks, cache.__contains__))
        for block in blocks:
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def slru(prompts: list[list[int]], capacity: int) -> list[int]:
    return _segmented(prompts, capacity, adaptive=False)


def arc(prompts: list[list[int]], capacity: int) -> list[int]:
    return _segmented(prompts, capacity, adaptive=True)


def _segmented(prompts: list[list[int]], capacity: int, adaptive: bool) -> list[int]:
    """Segmented LRU: with a fixed protected share, or (`adaptive`) with ARC's target for the
    probationary segment, moved by the blocks that come back after an eviction."""
    probation: OrderedDict[int, None] = OrderedDict()
    protected: OrderedDict[int, None] = OrderedDict()
    # Adaptive: the blocks evicted from probation and from protected, at most `capacity` each.
    recent: OrderedDict[int, None] = OrderedDict()
    frequent: OrderedDict[int, None] = OrderedDict()
    limit = capacity if adaptive else int(capacity * PROTECTED_SHARE)
    target = 0.0  # the probationary segment's target size
    hits = []
    for blocks in prompts:
        hits.append(_leading(blocks, lambda b: b in protected or b in probation))
        for block in blocks:
            if block in protected:
                protected.move_to_end(block)
                continue
            if block in probation:
                del probation[block]
            elif block in recent:
                target = min(capacity, target + max(len(frequent) / len(recent), 1))
                del recent[block]
            elif block in frequent:
                target = max(0.0, target - max(len(recent) / len(frequent), 1))
                del frequent[block]
            else:
                probation[block] = None
                continue
            protected[block] = None
            if len(protected) > limit:
                probation[protected.popitem(last=False)[0]] = None
        while len(probation) + len(protected) > capacity:
            if probation and (not adaptive or len(probation) > target or not protected):
                recent[probation.popitem(last=False)[0]] = None
            else:
                frequent[protected.popitem(last=False)[0]] = None
        for ghosts in (recent, frequent):
            while len(ghosts) > (capacity if adaptive else 0):
                ghosts.popitem(last=False)
    return hits


def lfu(prompts: list[list[int]], capacity: int) -> list[int]:
    counts: dict[int, tuple[int, int]] = {}  # block -> (uses, last use)
    heap: list[tuple[int, int, int]] = []  # entries go stale when a block is used again
    hits, now = [], 0
    for blocks in prompts:
        hits.append(_leading(blocks, counts.__contains__))
        for block in blocks:
            now += 1
            uses = counts[block][0] + 1 if block in counts else 1
            counts[block] = (uses, now)
            heapq.heappush(heap, (uses, now, block))
        while len(counts) > capacity:
            uses, last, block = heapq.heappop(heap)
            if counts.get(block) == (uses, last):
                del counts[block]
    return hits


def belady(prompts: list[list[int]], capacity: int) -> list[int]:
    uses = [block for blocks in prompts for block in blocks]
    following: list[float] = [math.inf] * len(uses)  # where each use's block is used next
    seen: dict[int, int] = {}
    for i in range(len(uses) - 1, -1, -1):
        following[i] = seen.get(uses[i], math.inf)
        seen[uses[i]] = i
    cache: dict[int, float] = {}  # block -> its next use
    heap: list[tuple[float, int]] = []  # (-next use, block); entries go stale on reuse
    hits, i = [], 0
    for blocks in prompts:
        hits.append(_leading(blocks, cache.__contains__))
        for block in blocks:
            upcoming, i = following[i], i + 1
            if block not in cache and len(cache) >= capacity:
                while cache.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if -heap[0][0] <= upcoming:
                    continue  # every cached block is needed sooner: this one is not kept
                del cache[heapq.heappop(heap)[1]]
            cache[block] = upcoming
            heapq.heappush(heap, (-upcoming, block))
    return hits


def _leading(blocks: list[int], cached: Callable[[int], bool]) -> int:
    for n, block in enumerate(blocks):
        if not cached(block):
            return n
    return len(blocks)


POLICIES = {"lru": lru, "slru": slru, "arc": arc, "lfu": lfu, "min": belady}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--blocks", type=int, default=8 * 16_384, help="the cache's capacity in blocks")
    args = parser.parse_args()
    trace, errors = read_trace(args.trace)
    if errors:
        sys.exit(f"{len(errors)} malformed lines in {args.trace}, the first: {errors[0]}")
    tokens = TraceTokens()
    prompts = [tokens.prompt_and_hashes(request, BLOCK_SIZE)[1] for request in trace]
    figures: dict[str, object] = {"trace": args.trace.name, "blocks": args.blocks}
    for name, policy in POLICIES.items():
        figures[name] = summary(trace, policy(prompts, args.blocks))
        print(f"{name}: {figures[name]}", file=sys.stderr)
    print(json.dumps(figures))


def summary(trace: list[TraceRequest], hits: list[int]) -> dict[str, float]:
    step, budget = StepTime(), MockerConfig().max_num_batched_tokens
    cached = [min(n * BLOCK_SIZE, r.input_length) for r, n in zip(trace, hits, strict=True)]
    bound = [alone_ms(step, r.input_length - c, budget) for r, c in zip(trace, cached, strict=True)]
    return {
        "hit_rate": round(sum(cached) / sum(r.input_length for r in trace), 4),
        "bound_ttft_mean_ms": round(statistics.mean(bound), 2),
    }


if __name__ == "__main__":
    main()
