"""KV router decision latency and KV event ingestion rate.

Setup: 64 workers and 1,000,000 indexed blocks (fed as KV event batches, msgpack-decoded as
the subscriber does, which is what the ingestion rate measures). 200 prompts of 8,000
tokens are cached on random workers at random prefix lengths; each timed request reuses a
random prefix of one of them and ends in fresh tokens. A decision is timed from the token
ids: hashing the 125 blocks of 64 tokens, the index walk, the cost model and bookkeeping.

    python benchmarks/router_decision.py [--workers 64] [--blocks 1000000] [--requests 5000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time

import msgspec

from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import BlockStored, KvEvent, KvEventBatch
from router.protocols import RouteRequest
from router.router import make_router

BLOCK = 64
TOKENS = 8000


def percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[int(len(ordered) * 0.99)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--requests", type=int, default=5000)
    args = ap.parse_args()
    rng = random.Random(0)
    router = make_router("kv", BLOCK, seed=0)
    workers = [f"worker-{i}" for i in range(args.workers)]
    for w in workers:
        router.add_worker(w, total_blocks=16384)

    prompts = [[rng.randrange(32000) for _ in range(TOKENS)] for _ in range(200)]
    prompt_hashes = [block_hashes(p, BLOCK) for p in prompts]
    event_ids = dict.fromkeys(workers, 0)
    payloads: list[bytes] = []
    encode = msgspec.msgpack.encode

    def batch(worker: str, hashes: list[int]) -> None:
        event_ids[worker] += 1
        events: list[KvEvent] = [BlockStored(blocks=hashes)]
        payloads.append(encode(KvEventBatch(worker_id=worker, event_id=event_ids[worker], events=events)))

    stored = 0
    for hashes in prompt_hashes:
        for w in rng.sample(workers, 3):
            n = rng.randrange(1, len(hashes) + 1)
            batch(w, hashes[:n])
            stored += n
    while stored < args.blocks:  # filler: unrelated prefixes, 125 blocks per batch
        hashes = [rng.getrandbits(64) for _ in range(125)]
        batch(rng.choice(workers), hashes)
        stored += len(hashes)

    decoder = msgspec.msgpack.Decoder(KvEventBatch)
    gc.collect()
    started, started_cpu = time.perf_counter(), time.process_time()
    for payload in payloads:
        router.apply_kv_batch(decoder.decode(payload))
    ingest_s, ingest_cpu_s = time.perf_counter() - started, time.process_time() - started_cpu
    ingest_rate, ingest_cpu_rate = stored / ingest_s, stored / ingest_cpu_s
    print(
        f"ingested {stored:,} blocks in {len(payloads):,} batches: {ingest_s:.2f} s wall "
        f"({ingest_rate:,.0f} blocks/s), {ingest_cpu_s:.2f} s CPU ({ingest_cpu_rate:,.0f} blocks/s)"
    )
    print(f"index holds {len(router.index.blocks):,} distinct blocks")  # type: ignore[union-attr]

    requests = []
    for i in range(args.requests):
        prompt = prompts[rng.randrange(len(prompts))]
        keep = rng.randrange(TOKENS)
        requests.append((f"r{i}", prompt[:keep] + [rng.randrange(32000) for _ in range(TOKENS - keep)]))
    latencies: list[float] = []
    cpu_latencies: list[float] = []
    hash_latencies: list[float] = []
    hits = 0
    in_flight: list[tuple[str, str]] = []
    gc.collect()
    for request_id, tokens in requests:
        t0, c0 = time.perf_counter(), time.process_time()
        hashes = block_hashes(tokens, BLOCK)
        t1 = time.perf_counter()
        decision = router.select(RouteRequest(request_id, len(tokens), hashes))
        latencies.append((time.perf_counter() - t0) * 1e6)
        hash_latencies.append((t1 - t0) * 1e6)
        cpu_latencies.append((time.process_time() - c0) * 1e6)
        hits += decision.overlap_blocks
        in_flight.append((decision.worker_id, request_id))
        if len(in_flight) > 256:  # keep a steady load of in-flight requests
            worker_id, done_id = in_flight.pop(0)
            router.on_finish(worker_id, done_id)
    p50, p99 = percentiles(latencies)
    cpu_p50, cpu_p99 = percentiles(cpu_latencies)
    hash_p50, hash_p99 = percentiles(hash_latencies)
    print(f"decision (hash + select), {args.workers} workers, {TOKENS} tokens in blocks of {BLOCK}:")
    print(f"  wall p50 {p50:.0f} us, p99 {p99:.0f} us; CPU p50 {cpu_p50:.0f} us, p99 {cpu_p99:.0f} us")
    print(f"  of which hashing the tokens (wall): p50 {hash_p50:.0f} us, p99 {hash_p99:.0f} us")
    load = os.getloadavg()[0]
    print(f"load average during the run: {load:.1f} on {os.cpu_count()} CPUs")
    print(f"mean overlap of chosen worker: {hits / len(requests):.1f} blocks")
    print(
        json.dumps(
            {
                "decision_p50_us": round(p50, 1),
                "decision_p99_us": round(p99, 1),
                "decision_cpu_p50_us": round(cpu_p50, 1),
                "decision_cpu_p99_us": round(cpu_p99, 1),
                "hashing_p50_us": round(hash_p50, 1),
                "hashing_p99_us": round(hash_p99, 1),
                "ingest_blocks_per_s": round(ingest_rate),
                "ingest_cpu_blocks_per_s": round(ingest_cpu_rate),
                "load_average": round(load, 1),
                "workers": args.workers,
                "indexed_blocks": stored,
            }
        )
    )


if __name__ == "__main__":
    main()
