"""Where a DeepInfer decode step's time goes: scheduling, the forward pass, sampling and
postprocessing, timed separately over steady batched decoding (SmolLM2-135M, float32,
`--threads` torch threads).

This bounds what overlapped scheduling (#14 item 4: schedule step N+1 while step N runs, as
mini-sglang's overlap loop does on a GPU) could gain here: only the scheduler's and
postprocessing's Python time can hide behind the model's, so the gain is at most their share
of the step. (Sampling needs the step's logits, so it cannot overlap that step's forward.)

Each of `--batch` requests has a distinct random prompt of `--prompt-tokens` and decodes
`--output-tokens` greedily (ignore_eos); the prefill steps are left out of the figures.
Final JSON line: per phase, the mean milliseconds per decode step and its share of the step.

    python benchmarks/step_phases.py [--batch 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.deepinfer.config import EngineConfig  # noqa: E402
from backends.deepinfer.engine import Engine  # noqa: E402
from backends.deepinfer.smollm2 import ensure_default_model  # noqa: E402
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest  # noqa: E402

PHASES = ("schedule", "forward", "sample", "postprocess")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=str(ensure_default_model()), device="cpu", num_kv_blocks=2048))
    rng = random.Random(0)
    for i in range(args.batch):
        engine.add(
            WorkerRequest(
                request_id=f"r{i}",
                token_ids=[rng.randrange(100, engine.vocab_size) for _ in range(args.prompt_tokens)],
                max_tokens=args.output_tokens,
                sampling=SamplingOptions(temperature=0.0),
                ignore_eos=True,
            )
        )
    totals = dict.fromkeys(PHASES, 0.0)
    steps = 0
    # Engine.step's beats, each timed (the lock is uncontended here).
    while engine.has_unfinished():
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        logits = engine.runner.execute(out)
        t2 = time.perf_counter()
        sampled = engine.sampler(logits, [c.seq for c in out.chunks if c.sample])
        t3 = time.perf_counter()
        engine.postprocess(out, sampled)
        t4 = time.perf_counter()
        if all(c.num_tokens == 1 for c in out.chunks):  # decode steps only
            steps += 1
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                totals[phase] += seconds
    step_ms = sum(totals.values()) * 1e3 / steps
    figures = {
        "model": "smollm2-135m-instruct",
        "threads": args.threads,
        "batch": args.batch,
        "decode_steps": steps,
        "step_ms": round(step_ms, 2),
        "phases_ms": {p: round(s * 1e3 / steps, 3) for p, s in totals.items()},
        "phases_share": {p: round(s * 1e3 / steps / step_ms, 4) for p, s in totals.items()},
        "overlap_bound": round((totals["schedule"] + totals["postprocess"]) * 1e3 / steps / step_ms, 4),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
