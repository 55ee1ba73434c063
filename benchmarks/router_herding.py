"""Herding on a shared system prompt, in virtual time: does a KV router starve workers when
every request starts with the same long prefix? (NVIDIA Dynamo users saw its KV router
leave 2 of 5 workers idle: issue 7836.)

The workload: Poisson arrivals at `--rate` requests/s; every prompt is one 4,096-token
system prompt followed by 512-2,048 tokens of its own; 50-300 output tokens. Eight mocker
workers (the default timing, 16,384 blocks of 64 tokens), routed by:
- `kv`: the KV router as it ships (overlap weight 1, the herding guard at its defaults);
- `kv-no-guard`: the same with the guard off (`balance_abs_requests=0`);
- `kv-w8`, `kv-w8-no-guard`: overlap weight 8, where a hit outweighs a queue of about
  eight requests of this size, with and without the guard;
- `round-robin`: the reference for an even spread.
Per run: requests per worker (min, max, coefficient of variation), hit rate, mean and p99
TTFT.

    python benchmarks/router_herding.py [--rate 12] [--seconds 300]

Ends with one JSON line of every run's figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.mocker.config import MockerConfig  # noqa: E402
from backends.mocker.replay import OfflineReplay, VirtualClock  # noqa: E402
from router.replay import TraceRequest, TraceTokens, summarize  # noqa: E402
from router.router import make_router  # noqa: E402

TRACE_BLOCK = 512
SYSTEM_BLOCKS = 8  # 4,096 tokens
WORKERS = 8

RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "kv": ("kv", {}),
    "kv-no-guard": ("kv", {"balance_abs_requests": 0}),
    "kv-w8": ("kv", {"overlap_weight": 8.0}),
    "kv-w8-no-guard": ("kv", {"overlap_weight": 8.0, "balance_abs_requests": 0}),
    "round-robin": ("round-robin", {}),
}


def workload(rate: float, seconds: float, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    at, fresh = 0.0, SYSTEM_BLOCKS
    while at < seconds * 1e3:
        at += rng.expovariate(rate) * 1e3
        own = rng.randint(TRACE_BLOCK, 4 * TRACE_BLOCK)
        blocks = -(-own // TRACE_BLOCK)
        hash_ids = (*range(SYSTEM_BLOCKS), *range(fresh, fresh + blocks))
        fresh += blocks
        tokens = SYSTEM_BLOCKS * TRACE_BLOCK + own
        requests.append(TraceRequest(len(requests), at, tokens, rng.randint(50, 300), hash_ids))
    return requests


def replay(trace: list[TraceRequest], mode: str, params: dict[str, Any]) -> dict[str, Any]:
    clock = VirtualClock()
    router = make_router(mode, 64, clock=clock, seed=0, **params)
    records = OfflineReplay(router, MockerConfig(), WORKERS, TraceTokens(TRACE_BLOCK), clock=clock).run(trace)
    figures = summarize(records, mode).figures
    per_worker = [sum(r.worker_id == f"mocker-{i}" for r in records) for i in range(WORKERS)]
    return {
        "worker_requests": per_worker,
        "worker_requests_min": min(per_worker),
        "worker_requests_max": max(per_worker),
        "worker_requests_cv": round(statistics.pstdev(per_worker) / statistics.mean(per_worker), 3),
        "hit_rate": figures["hit_rate"],
        "ttft_mean_ms": figures["ttft_mean_ms"],
        "ttft_p99_ms": figures["ttft_p99_ms"],
        "completed": figures["completed"],
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--rate", type=float, default=12.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=300.0, help="length of the workload")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    trace = workload(args.rate, args.seconds, args.seed)
    results: dict[str, Any] = {"requests": len(trace), "rate": args.rate, "workers": WORKERS}
    for name, (mode, params) in RUNS.items():
        result = replay(trace, mode, params)
        results[name] = result
        print(
            f"{name:15} requests per worker {result['worker_requests_min']}-{result['worker_requests_max']} "
            f"(cv {result['worker_requests_cv']}), hit rate {result['hit_rate']}, "
            f"TTFT mean {result['ttft_mean_ms']} ms, p99 {result['ttft_p99_ms']} ms",
            file=sys.stderr,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
