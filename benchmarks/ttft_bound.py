"""How low any router could take mean TTFT on a trace: the prefill each request cannot avoid.

A request's TTFT is at least the time its uncached tokens take to prefill on an idle worker,
in the best chunking the engine's token budget allows (`alone_ms`, with
`router.step_time.StepTime`, the step model the mocker simulates steps with). A router
decides which worker's cache a request meets, so how many tokens are cached, and how long it
queues; it cannot make a worker cache more than its capacity allows. Three
replays of the trace (virtual time, `backends.mocker.replay.OfflineReplay`), each with that
lower bound computed from the prefix hits every request actually got:

- `routed`: `--workers` workers of `--num-blocks` blocks each under `--router-mode`, with its
  measured mean TTFT beside the bound (their difference is the queueing);
- `pooled`: one worker holding all of their blocks, one LRU cache as large as the cluster's
  (its own TTFT is meaningless, one worker takes the whole load; its bound is what matters:
  no router over LRU workers of that total size is likely to get more hits);
- `unbounded`: one worker with a block for every token the trace computes, so nothing is
  evicted: every reuse the trace holds.

    python benchmarks/ttft_bound.py [--trace T] [--workers 8] [--num-blocks 16384] [--router-mode ttft]
        [--router-seed 0]

Ends with one JSON line: per replay the hit rate (cached over prompt tokens), mean TTFT, the
bound's mean, and how many requests were faster than their bound (`below_bound`: 0, or the
bound is not one).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.mocker.config import MockerConfig  # noqa: E402
from backends.mocker.replay import OfflineReplay, VirtualClock  # noqa: E402
from router.replay import TraceRequest, TraceTokens, read_trace  # noqa: E402
from router.router import make_router  # noqa: E402
from router.step_time import StepTime  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
BLOCK_SIZE = 64


def replay(
    trace: list[TraceRequest], workers: int, num_blocks: int, router_mode: str, seed: int
) -> dict[str, Any]:
    clock = VirtualClock()
    longest = max(r.input_length + r.output_length for r in trace)
    config = MockerConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        context_length=max(longest, MockerConfig().context_length),
    )
    router = make_router(router_mode, BLOCK_SIZE, clock=clock, seed=seed)
    records = OfflineReplay(router, config, workers, TraceTokens(), clock=clock).run(trace)
    step = StepTime()
    budget = config.max_num_batched_tokens
    ttft = [r.first_token_ms - r.arrival_ms for r in records if r.first_token_ms is not None]
    bound = [alone_ms(step, r.prompt_tokens - r.cached_tokens, budget) for r in records]
    violations = sum(
        r.first_token_ms - r.arrival_ms < b - 1e-6
        for r, b in zip(records, bound, strict=True)
        if r.first_token_ms is not None
    )
    return {
        "hit_rate": round(sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records), 4),
        "ttft_mean_ms": round(statistics.mean(ttft), 2),
        "bound_ttft_mean_ms": round(statistics.mean(bound), 2),
        "below_bound": violations,  # requests faster than their bound: 0, or the bound is wrong
    }


def alone_ms(step: StepTime, tokens: int, budget: int) -> float:
    """The least time `tokens` prompt tokens can take on an idle worker: in k steps of at most
    `budget` tokens, the best k (a step's fixed cost against its quadratic one), equal chunks,
    each rounded down (so never more than the real cost)."""
    if tokens <= 0:
        return 0.0
    fewest = math.ceil(tokens / budget)
    c0, _, c2 = (*step.prefill_ms, 0.0, 0.0)[:3]
    best = tokens * math.sqrt(c2 / c0) if c0 > 0 and c2 > 0 else fewest
    candidates = {fewest, max(fewest, math.floor(best)), max(fewest, math.ceil(best))}
    return min(k * step.prefill(tokens // k) for k in candidates)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=16_384)
    parser.add_argument("--router-mode", default="ttft")
    parser.add_argument("--router-seed", type=int, default=0, help="as weir replay's (default 0)")
    args = parser.parse_args()
    trace, errors = read_trace(args.trace)
    if errors:
        sys.exit(f"{len(errors)} malformed lines in {args.trace}, the first: {errors[0]}")
    figures: dict[str, Any] = {
        "trace": args.trace.name,
        "workers": args.workers,
        "num_blocks": args.num_blocks,
    }
    figures["routed"] = {
        "router": args.router_mode,
        **replay(trace, args.workers, args.num_blocks, args.router_mode, args.router_seed),
    }
    print(f"routed ({args.router_mode}): {figures['routed']}", file=sys.stderr)
    figures["pooled"] = replay(trace, 1, args.workers * args.num_blocks, "kv", args.router_seed)
    print(
        f"pooled (one LRU cache of {args.workers * args.num_blocks} blocks): {figures['pooled']}",
        file=sys.stderr,
    )
    every_block = sum(-(-(r.input_length + r.output_length) // BLOCK_SIZE) for r in trace)
    figures["unbounded"] = replay(trace, 1, every_block, "kv", args.router_seed)
    print(f"unbounded cache: {figures['unbounded']}", file=sys.stderr)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
