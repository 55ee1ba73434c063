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

On a GPU (`--device cuda`, bfloat16; `--model smollm2-shape` where SmolLM2's package cannot
go: random weights in its shape) the forward only enqueues its kernels and sampling waits for
them, so the phases split the host's time, not the model's. There the JSON line also has
`gpu_busy_ms`, the time per decode step the GPU spends in kernels and copies (the torch
profiler's device time, summed over the decode steps of a second pass), and `overlap_bound`
is the share of the step the GPU is idle: the most any overlap could hide. A first pass,
untimed, captures the CUDA graphs the batch uses.

    python benchmarks/step_phases.py [--batch 32] [--threads 1]
    python benchmarks/step_phases.py --device cuda --model smollm2-shape
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.deepinfer.config import EngineConfig  # noqa: E402
from backends.deepinfer.engine import Engine  # noqa: E402
from backends.deepinfer.smollm2 import ensure_default_model  # noqa: E402
from backends.deepinfer.tiny import build_checkpoint  # noqa: E402
from benchmarks.engine_throughput import RANDOM_MODELS  # noqa: E402
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest  # noqa: E402

PHASES = ("schedule", "forward", "sample", "postprocess")


def decode_phases(
    engine: Engine, args: argparse.Namespace, tag: str, profiler: torch.profiler.profile | None = None
) -> tuple[dict[str, float], int]:
    """Run the batch to the end; each phase's seconds over the decode steps, and their count.
    `profiler` is started at the first decode step (the prefill's kernels are not counted)
    and stopped at the end."""
    rng = random.Random(0)
    for i in range(args.batch):
        engine.add(
            WorkerRequest(
                request_id=f"r{i}-{tag}",
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
        decode = all(c.num_tokens == 1 for c in out.chunks)
        if profiler is not None and decode and not steps:
            profiler.start()
        t1 = time.perf_counter()
        logits = engine.runner.execute(out)
        t2 = time.perf_counter()
        sampled = engine.sampler(logits, [c.seq for c in out.chunks if c.sample])
        t3 = time.perf_counter()
        engine.postprocess(out, sampled)
        t4 = time.perf_counter()
        if decode:  # decode steps only (the batch prefills in the first steps, then decodes)
            steps += 1
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                totals[phase] += seconds
    if profiler is not None:
        profiler.stop()
    return totals, steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bfloat16)")
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "smollm2-shape"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    scratch = tempfile.TemporaryDirectory()  # removed at exit
    if args.model == "smollm2":
        model_dir = ensure_default_model()
    else:
        model_dir = build_checkpoint(Path(scratch.name), "llama", **RANDOM_MODELS[args.model])
    dtype = "bfloat16" if cuda else "float32"
    engine = Engine(EngineConfig(model=str(model_dir), device=args.device, dtype=dtype, num_kv_blocks=2048))
    if cuda:
        decode_phases(engine, args, "warm-up")  # captures the CUDA graphs this batch uses
    totals, steps = decode_phases(engine, args, "timed")
    gpu_ms = 0.0
    if cuda:
        # Another pass, profiled, for the GPU's busy time (kernels and copies): the profiler
        # slows the host, so the phases are timed in the one before.
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        _, profiled_steps = decode_phases(engine, args, "profiled", profiler)
        gpu_ms = sum(e.self_device_time_total for e in profiler.key_averages()) / 1e3 * steps / profiled_steps
    step_ms = sum(totals.values()) * 1e3 / steps
    host_bound = (totals["schedule"] + totals["postprocess"]) * 1e3 / steps / step_ms
    figures = {
        "model": "smollm2-135m-instruct" if args.model == "smollm2" else args.model,
        "device": torch.cuda.get_device_name(args.device) if cuda else "cpu",
        "threads": args.threads,
        "batch": args.batch,
        "decode_steps": steps,
        "step_ms": round(step_ms, 2),
        "phases_ms": {p: round(s * 1e3 / steps, 3) for p, s in totals.items()},
        "phases_share": {p: round(s * 1e3 / steps / step_ms, 4) for p, s in totals.items()},
        "gpu_busy_ms": round(gpu_ms / steps, 3) if cuda else None,
        "overlap_bound": round(1 - gpu_ms / steps / step_ms if cuda else host_bound, 4),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
