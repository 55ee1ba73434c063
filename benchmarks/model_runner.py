"""DeepInfer's model runner alone: batched greedy decoding, normal vs deterministic mode.

Drives `ModelRunner.execute` directly (no scheduler, no sampler: argmax), so the figures are
the model side's own cost: one prefill step for all sequences, then one decode step per token.
Deterministic mode runs one forward pass per chunk (batch-invariant numerics); the ratio of
the two is what that mode costs on this machine.

    python benchmarks/model_runner.py                       # tiny Llama (hidden 256, 4 layers)
    python benchmarks/model_runner.py --model DIR --seqs 16 --steps 16

Ends with one JSON line: `tok_s`, `det_tok_s`, `det_slowdown` (by CPU time), and the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.deepinfer.config import EngineConfig  # noqa: E402
from backends.deepinfer.model_runner import ModelRunner  # noqa: E402
from backends.deepinfer.outputs import ScheduledChunk, SchedulerOutput  # noqa: E402
from backends.deepinfer.sequence import Sequence  # noqa: E402
from backends.deepinfer.tiny import build_checkpoint  # noqa: E402
from orchestrator.runtime.protocol import WorkerRequest  # noqa: E402

BLOCK_SIZE = 16


def run(runner: ModelRunner, prompts: list[list[int]], steps: int) -> dict[str, float]:
    seqs = [
        Sequence(WorkerRequest(request_id=str(i), token_ids=p, max_tokens=steps))
        for i, p in enumerate(prompts)
    ]
    per_seq = -(-(len(prompts[0]) + steps) // BLOCK_SIZE)
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
    wall, cpu = time.perf_counter(), time.process_time()
    chunks = [ScheduledChunk(s, 0, len(s.token_ids), True) for s in seqs]
    for _ in range(steps):
        logits = runner.execute(SchedulerOutput(chunks))
        for seq, token in zip(seqs, logits.argmax(dim=-1).tolist(), strict=True):
            seq.token_ids.append(token)
        chunks = [ScheduledChunk(s, len(s.token_ids) - 1, 1, True) for s in seqs]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = len(prompts) * steps
    return {"tok_s": tokens / wall, "cpu_tok_s": tokens / cpu, "wall_s": wall, "cpu_s": cpu}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: a tiny Llama built here)")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (shared machine: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_checkpoint(
            Path(tmp), "llama", hidden_size=256, num_hidden_layers=4, intermediate_size=768, head_dim=32,
            num_attention_heads=8, num_key_value_heads=4,
        )  # fmt: skip
        results: dict[str, Any] = {}
        for mode in ("normal", "deterministic"):
            config = EngineConfig(
                model=str(model),
                block_size=BLOCK_SIZE,
                num_kv_blocks=args.seqs * -(-(args.prompt + args.steps) // BLOCK_SIZE),
                deterministic=mode == "deterministic",
            )
            runner = ModelRunner(config)
            g = torch.Generator().manual_seed(0)
            prompts = [
                torch.randint(3, runner.vocab_size, (args.prompt,), generator=g).tolist()
                for _ in range(args.seqs)
            ]
            run(runner, prompts[:2], 2)  # warm up
            results[mode] = run(runner, prompts, args.steps)
            r = results[mode]
            print(
                f"{mode:>13}: {args.seqs} x {args.prompt} -> {args.steps}: {r['tok_s']:.0f} tok/s wall "
                f"({r['wall_s']:.2f} s), {r['cpu_tok_s']:.0f} tok/s of CPU time ({r['cpu_s']:.2f} s)"
            )
    slowdown = results["deterministic"]["cpu_s"] / results["normal"]["cpu_s"]
    print(f"deterministic mode costs {slowdown:.1f}x CPU time; load average {os.getloadavg()[0]:.1f}")
    summary = {
        "model": str(args.model or "tiny-llama-h256-l4"),
        "seqs": args.seqs,
        "prompt": args.prompt,
        "steps": args.steps,
        "threads": args.threads,
        "tok_s": round(results["normal"]["tok_s"], 1),
        "cpu_tok_s": round(results["normal"]["cpu_tok_s"], 1),
        "det_tok_s": round(results["deterministic"]["tok_s"], 1),
        "det_cpu_tok_s": round(results["deterministic"]["cpu_tok_s"], 1),
        "det_slowdown": round(slowdown, 2),
        "load_average": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
