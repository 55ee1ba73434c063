"""KV router decision latency and KV event ingestion rate.

Setup: 64 workers and 1,000,000 indexed blocks (fed as KV event batches, msgpack-decoded as
the subscriber does, which is what the ingestion rate measures). 200 prompts of 8,000
tokens are cached on random workers at random prefix lengths; each timed request reuses a
random prefix of one of them and ends in fresh tokens, and 256 requests stay in flight. A
decision is timed from the token ids: hashing the 125 blocks of 64 tokens, the index walk,
the cost model, load bookkeeping and metrics (`Router.select`).

The issue's targets are "on one core", and this machine's cores are shared, so the headline
figures are CPU time of the benchmark's thread (`time.thread_time_ns`), which time spent
waiting for a core does not inflate; wall-clock figures are reported next to them. After
setup the objects built so far are frozen out of the garbage collector (`gc.freeze()`, as a
long-running server does after start-up), so collections see only what decisions allocate.
`--warmup` decisions run first and are not counted. A burst of load from another user can
move a p99 by 100 us, so the timed decisions run in `--rounds` consecutive rounds and the
headline p99 is the median of the rounds' p99s (each round's is shown, and the p99 over all
decisions is kept too). The one-minute load average is shown before and after the run.
A decision during which the thread was preempted (its involuntary context-switch count
moved) still counts in every figure, but is also left out of the `undisturbed` ones: its
CPU time pays for refilling caches another process evicted.

Final JSON line:
  decision_p50_us, decision_p99_us    hash + select, thread CPU time (the targets); the p50
                                      over all decisions, the p99 the median of the rounds'
  decision_round_p99_us, decision_pooled_p99_us   each round's p99; the p99 over all decisions
  decision_wall_p50_us, decision_wall_p99_us, decision_wall_max_us   the same, wall clock
  decision_undisturbed_p50_us, decision_undisturbed_p99_us   thread CPU time of the decisions
                                      not preempted; preempted_decisions counts the others
  hashing_p50_us, hashing_p99_us      `block_hashes` alone, thread CPU time, over all decisions
  select_p50_us, select_p99_us        `Router.select` alone, likewise
  ingest_blocks_per_s                 blocks applied per second of thread CPU time
  ingest_wall_blocks_per_s            the same per second of wall clock
  load_average_before, load_average_after, workers, indexed_blocks, decisions

    python benchmarks/router_decision.py [--workers 64] [--blocks 1000000] [--requests 10000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import time
from array import array
from collections import deque

import msgspec

from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import BlockStored, KvEvent, KvEventBatch
from router.protocols import RouteRequest
from router.router import Router, make_router

BLOCK = 64
TOKENS = 8000
PROMPTS = 200
IN_FLIGHT = 256


def percentile(ordered: list[int], q: float) -> float:
    """Nearest-rank percentile of sorted nanoseconds, in microseconds."""
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)] / 1e3


def build_batches(
    workers: list[str], blocks: int, prompts: list[array[int]], rng: random.Random
) -> tuple[list[bytes], int]:
    """Encoded KV event batches and their block count: each prompt's prefix on 3 workers,
    then unrelated filler."""
    event_ids = dict.fromkeys(workers, 0)
    payloads: list[bytes] = []
    encode = msgspec.msgpack.encode
    stored = 0

    def batch(worker: str, hashes: list[int]) -> None:
        event_ids[worker] += 1
        events: list[KvEvent] = [BlockStored(blocks=hashes)]
        payloads.append(encode(KvEventBatch(worker_id=worker, event_id=event_ids[worker], events=events)))

    for hashes in (block_hashes(p, BLOCK) for p in prompts):
        for w in rng.sample(workers, 3):
            n = rng.randrange(1, len(hashes) + 1)
            batch(w, hashes[:n])
            stored += n
    while stored < blocks:  # filler: unrelated prefixes, 125 blocks per batch
        hashes = [rng.getrandbits(64) for _ in range(125)]
        batch(rng.choice(workers), hashes)
        stored += len(hashes)
    return payloads, stored


def ingest(router: Router, payloads: list[bytes]) -> tuple[float, float]:
    """Decode and apply every batch: (thread CPU seconds, wall seconds)."""
    decoder = msgspec.msgpack.Decoder(KvEventBatch)
    gc.collect()
    started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
    for payload in payloads:
        router.apply_kv_batch(decoder.decode(payload))
    return (time.thread_time_ns() - started_cpu) / 1e9, (time.perf_counter_ns() - started) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--requests", type=int, default=10_000, help="timed decisions, all rounds together")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=500)
    args = ap.parse_args()
    rng = random.Random(0)
    router = make_router("kv", BLOCK, seed=0)
    workers = [f"worker-{i}" for i in range(args.workers)]
    for w in workers:
        router.add_worker(w, total_blocks=16384)

    # Token ids are kept as arrays and each request's list is built fresh outside the timed
    # region, as a tokenizer hands it over: new int objects, not ones from a cold heap.
    prompts = [array("I", [rng.randrange(32000) for _ in range(TOKENS)]) for _ in range(PROMPTS)]
    payloads, stored = build_batches(workers, args.blocks, prompts, rng)
    ingest_cpu_s, ingest_wall_s = ingest(router, payloads)
    del payloads
    ingest_rate, ingest_wall_rate = stored / ingest_cpu_s, stored / ingest_wall_s
    print(
        f"ingested {stored:,} blocks: {ingest_cpu_s:.2f} s CPU ({ingest_rate:,.0f} blocks/s), "
        f"{ingest_wall_s:.2f} s wall ({ingest_wall_rate:,.0f} blocks/s)"
    )
    print(f"index holds {len(router.index.blocks):,} distinct blocks")  # type: ignore[union-attr]

    # Fresh request tails are slices of one random pool.
    noise = array("I", [rng.randrange(32000) for _ in range(4 * TOKENS)])
    in_flight: deque[tuple[str, str]] = deque()
    hash_ns: list[int] = []
    select_ns: list[int] = []
    cpu_ns: list[int] = []
    wall_ns: list[int] = []
    hits = 0
    gc.collect()
    gc.freeze()
    undisturbed_ns: list[int] = []
    rounds_ns: list[list[int]] = [[] for _ in range(args.rounds)]
    load_before = os.getloadavg()[0]
    for i in range(args.warmup + args.requests):
        keep = rng.randrange(TOKENS)
        start = rng.randrange(len(noise) - TOKENS)
        tokens = (prompts[rng.randrange(PROMPTS)][:keep] + noise[start : start + TOKENS - keep]).tolist()
        request_id = f"r{i}"
        switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        hashes = block_hashes(tokens, BLOCK)
        c1 = time.thread_time_ns()
        decision = router.select(RouteRequest(request_id, len(tokens), hashes))
        c2, t2 = time.thread_time_ns(), time.perf_counter_ns()
        preempted = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw != switches
        in_flight.append((decision.worker_id, request_id))
        if len(in_flight) > IN_FLIGHT:  # keep a steady load of in-flight requests
            router.on_finish(*in_flight.popleft())
        if i >= args.warmup:
            hash_ns.append(c1 - c0)
            select_ns.append(c2 - c1)
            cpu_ns.append(c2 - c0)
            rounds_ns[(i - args.warmup) * args.rounds // args.requests].append(c2 - c0)
            wall_ns.append(t2 - t0)
            if not preempted:
                undisturbed_ns.append(c2 - c0)
            hits += decision.overlap_blocks
    load_after = os.getloadavg()[0]
    for values in (hash_ns, select_ns, cpu_ns, wall_ns, undisturbed_ns, *rounds_ns):
        values.sort()
    round_p99 = [percentile(values, 0.99) for values in rounds_ns]
    p50, p99, pooled_p99 = percentile(cpu_ns, 0.5), statistics.median(round_p99), percentile(cpu_ns, 0.99)
    calm_p50, calm_p99 = percentile(undisturbed_ns, 0.5), percentile(undisturbed_ns, 0.99)
    preempted_count = len(cpu_ns) - len(undisturbed_ns)
    wall_p50, wall_p99, wall_max = percentile(wall_ns, 0.5), percentile(wall_ns, 0.99), wall_ns[-1] / 1e3
    print(
        f"{args.requests:,} decisions (hash + select) in {args.rounds} rounds after {args.warmup} warm-up, "
        f"{args.workers} workers, "
        f"{TOKENS} tokens in blocks of {BLOCK}:"
    )
    print(f"  thread CPU p50 {p50:.0f} us, p99 {p99:.0f} us (median of rounds), {pooled_p99:.0f} us (all)")
    print(f"    p99 by round: {', '.join(f'{v:.0f}' for v in round_p99)} us")
    print(f"    hashing       p50 {percentile(hash_ns, 0.5):.0f} us, p99 {percentile(hash_ns, 0.99):.0f} us")
    print(
        f"    select        p50 {percentile(select_ns, 0.5):.0f} us, p99 {percentile(select_ns, 0.99):.0f} us"
    )
    print(
        f"  undisturbed ({len(undisturbed_ns):,} not preempted): p50 {calm_p50:.0f} us, p99 {calm_p99:.0f} us"
    )
    print(f"  wall       p50 {wall_p50:.0f} us, p99 {wall_p99:.0f} us, max {wall_max:.0f} us")
    print(f"load average {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} CPUs")
    print(f"mean overlap of chosen worker: {hits / args.requests:.1f} blocks")
    print(
        json.dumps(
            {
                "decision_p50_us": round(p50, 1),
                "decision_p99_us": round(p99, 1),
                "decision_round_p99_us": [round(v, 1) for v in round_p99],
                "decision_pooled_p99_us": round(pooled_p99, 1),
                "decision_wall_p50_us": round(wall_p50, 1),
                "decision_wall_p99_us": round(wall_p99, 1),
                "decision_wall_max_us": round(wall_max, 1),
                "decision_undisturbed_p50_us": round(calm_p50, 1),
                "decision_undisturbed_p99_us": round(calm_p99, 1),
                "preempted_decisions": preempted_count,
                "hashing_p50_us": round(percentile(hash_ns, 0.5), 1),
                "hashing_p99_us": round(percentile(hash_ns, 0.99), 1),
                "select_p50_us": round(percentile(select_ns, 0.5), 1),
                "select_p99_us": round(percentile(select_ns, 0.99), 1),
                "ingest_blocks_per_s": round(ingest_rate),
                "ingest_wall_blocks_per_s": round(ingest_wall_rate),
                "load_average_before": round(load_before, 2),
                "load_average_after": round(load_after, 2),
                "workers": args.workers,
                "indexed_blocks": stored,
                "decisions": args.requests,
            }
        )
    )


if __name__ == "__main__":
    main()
