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
import random
import statistics
import time

import msgspec

from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import BlockStored, KvEventBatch
from router.protocols import RouteRequest
from router.router import make_router

BLOCK = 64
TOKENS = 8000


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

    def batch(worker: str, hashes: list[int]) -> None:
        event_ids[worker] += 1
        event = BlockStored(blocks=hashes)
        payloads.append(msgspec.msgpack.encode(KvEventBatch(worker_id=worker, event_id=event_ids[worker], events=[event])))

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
    started = time.perf_counter()
    for payload in payloads:
        router.apply_kv_batch(decoder.decode(payload))
    ingest_s = time.perf_counter() - started
    ingest_rate = stored / ingest_s
    print(f"ingested {stored:,} blocks in {len(payloads):,} batches: {ingest_s:.2f} s, {ingest_rate:,.0f} blocks/s")
    print(f"index holds {len(router.index.blocks):,} distinct blocks")  # type: ignore[union-attr]

    requests = []
    for i in range(args.requests):
        prompt = prompts[rng.randrange(len(prompts))]
        keep = rng.randrange(TOKENS)
        requests.append((f"r{i}", prompt[:keep] + [rng.randrange(32000) for _ in range(TOKENS - keep)]))
    latencies: list[float] = []
    hits = 0
    in_flight: list[tuple[str, str]] = []
    gc.collect()
    for request_id, tokens in requests:
        t0 = time.perf_counter()
        hashes = block_hashes(tokens, BLOCK)
        decision = router.select(RouteRequest(request_id, len(tokens), hashes))
        latencies.append((time.perf_counter() - t0) * 1e6)
        hits += decision.overlap_blocks
        in_flight.append((decision.worker_id, request_id))
        if len(in_flight) > 256:  # keep a steady load of in-flight requests
            worker_id, done_id = in_flight.pop(0)
            router.on_finish(worker_id, done_id)
    latencies.sort()
    p50 = statistics.median(latencies)
    p99 = latencies[int(len(latencies) * 0.99)]
    print(f"decision (hash + select), {args.workers} workers, {TOKENS} tokens: p50 {p50:.0f} us, p99 {p99:.0f} us")
    print(f"mean overlap of chosen worker: {hits / len(requests):.1f} blocks")
    print(
        json.dumps(
            {
                "decision_p50_us": round(p50, 1),
                "decision_p99_us": round(p99, 1),
                "ingest_blocks_per_s": round(ingest_rate),
                "workers": args.workers,
                "indexed_blocks": stored,
            }
        )
    )


if __name__ == "__main__":
    main()
