"""MockerCore simulation speed: how many requests per second of wall time a replay can push.

Setup: 8 MockerCores with Dynamo's defaults (16,384 blocks of 64 tokens, 8,192 batched
tokens, 256 sequences) share 4,000 requests round-robin, all queued at once. Prompts are
256-1,023 tokens of one of 20 shared prefixes followed by 64-1,023 fresh tokens; outputs
are 32-255 tokens. After every step the driver does what the offline replay does: drain
KV events and read a load report. Prompt block hashes are computed up front, as the
router does once per request, and are not timed.

    python benchmarks/mocker_core.py [--requests 4000] [--workers 8]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from backends.mocker.config import MockerConfig
from backends.mocker.core import MockerCore
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import WorkerRequest


def make_requests(n: int, block_size: int, rng: random.Random) -> list[WorkerRequest]:
    prefixes = [[rng.randrange(32_000) for _ in range(1024)] for _ in range(20)]
    requests = []
    for i in range(n):
        prompt = prefixes[rng.randrange(20)][: rng.randrange(256, 1024)]
        prompt += [rng.randrange(32_000) for _ in range(rng.randrange(64, 1024))]
        requests.append(
            WorkerRequest(
                request_id=f"r{i}",
                token_ids=prompt,
                max_tokens=rng.randrange(32, 256),
                block_hashes=block_hashes(prompt, block_size),
                ignore_eos=True,  # exactly these output lengths, as the figures in docs/mocker.md
            )
        )
    return requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    config = MockerConfig()
    requests = make_requests(args.requests, config.block_size, random.Random(0))
    cores = [MockerCore(config) for _ in range(args.workers)]

    started, cpu_started = time.perf_counter(), time.process_time()
    for i, request in enumerate(requests):
        cores[i % args.workers].add(request)
    steps = tokens = events = 0
    for core in cores:
        while core.has_work():
            result = core.step()
            steps += 1
            tokens += sum(len(out.token_ids) for out in result.outputs)
            events += sum(len(batch.events) for batch in core.take_kv_events())
            core.load()
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started  # on a shared machine, CPU time is the steadier figure

    simulated_s = max(core.clock_ms for core in cores) / 1000
    print(
        f"{args.requests} requests on {args.workers} mocker cores: "
        f"{elapsed:.2f} s wall, {simulated_s:.1f} s simulated"
    )
    print(f"{args.requests / elapsed:.0f} requests/s, {tokens / elapsed:.0f} output tokens/s, {steps} steps")
    print(f"per CPU second: {args.requests / cpu:.0f} requests, {tokens / cpu:.0f} output tokens")
    print(
        json.dumps(
            {
                "requests_per_s": round(args.requests / elapsed),
                "output_tokens_per_s": round(tokens / elapsed),
                "requests_per_cpu_s": round(args.requests / cpu),
                "steps_per_s": round(steps / elapsed),
                "cpu_us_per_token_step": round(cpu / tokens * 1e6, 2),
                "simulated_s": round(simulated_s, 1),
                "kv_events": events,
            }
        )
    )


if __name__ == "__main__":
    main()
