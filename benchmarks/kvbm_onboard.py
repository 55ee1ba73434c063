"""How much of an onboarded prefix's copy DeepInfer hides behind the forward pass.

One sequence of `--prefix-tokens` cached tokens plus `--new-tokens` to prefill, on the model
runner alone (no scheduler, no tiers: the payloads are in host memory already, as after a
host-tier hit). Three ways to run the step, interleaved `--reps` times, median of each:
- `compute_ms`: the prefix's KV already in the cache, no load at all;
- `serial_ms`: the blocks written into the cache first (`write_blocks`), then the forward;
- `layerwise_ms`: the forward with the loads in flight (`SchedulerOutput.loads`), each layer
  waiting for its own blocks while the loader writes the later ones.
`hidden` = (serial - layerwise) / (serial - compute): the share of the copy's time the
layer-wise load takes off the step (1.0: the load is free). The logits of all three are
asserted equal. Torch runs one thread, as in the tests, so the loader has the other core.

    python benchmarks/kvbm_onboard.py                 # SmolLM2-135M-Instruct
    python benchmarks/kvbm_onboard.py --model tiny    # a tiny random Llama

Ends with one JSON line: `model`, `layers`, `prefix_tokens`, `new_tokens`, `load_mb`,
`compute_ms`, `serial_ms`, `layerwise_ms`, `hidden`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models import MODELS, deepinfer_model  # noqa: E402

from backends.deepinfer.config import EngineConfig  # noqa: E402
from backends.deepinfer.model_runner import ModelRunner  # noqa: E402
from backends.deepinfer.outputs import BlockLoad, ScheduledChunk, SchedulerOutput  # noqa: E402
from backends.deepinfer.sequence import Sequence  # noqa: E402
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--prefix-tokens", type=int, default=1536)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if args.prefix_tokens % args.block_size:
        parser.error("--prefix-tokens must be a multiple of --block-size")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        directory = deepinfer_model(args.model, Path(scratch))
        total = args.prefix_tokens + args.new_tokens
        num_blocks = -(-total // args.block_size)
        runner = ModelRunner(
            EngineConfig(
                model=str(directory), device="cpu", block_size=args.block_size, num_kv_blocks=num_blocks + 1
            )
        )
        rng = random.Random(0)
        tokens = [rng.randrange(3, 500) for _ in range(total)]
        seq = Sequence(
            WorkerRequest(
                request_id="b", token_ids=tokens, max_tokens=1, sampling=SamplingOptions(temperature=0.0)
            )
        )
        seq.block_table = list(range(1, num_blocks + 1))
        prefix = seq.block_table[: args.prefix_tokens // args.block_size]
        runner.execute(SchedulerOutput(chunks=[ScheduledChunk(seq, 0, total, True)]))  # the prefix's KV
        payloads = runner.kv_cache.read_blocks(prefix)

        def step(loads: list[BlockLoad]) -> torch.Tensor:
            out = SchedulerOutput(chunks=[ScheduledChunk(seq, args.prefix_tokens, args.new_tokens, True)])
            out.loads = loads
            return runner.execute(out)

        def compute() -> torch.Tensor:
            return step([])

        def serial() -> torch.Tensor:
            runner.kv_cache.write_blocks(prefix, payloads)
            return step([])

        def layerwise() -> torch.Tensor:
            return step([BlockLoad(b, "host", p) for b, p in zip(prefix, payloads, strict=True)])

        runs = {"compute": compute, "serial": serial, "layerwise": layerwise}
        times: dict[str, list[float]] = {name: [] for name in runs}
        logits: dict[str, torch.Tensor] = {}
        for name, run in runs.items():  # warm-up, and the logits to compare
            logits[name] = run()
        assert torch.equal(logits["serial"], logits["compute"]), "serial load changed the logits"
        assert torch.equal(logits["layerwise"], logits["compute"]), "layer-wise load changed the logits"
        for _ in range(args.reps):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
        ms = {name: 1000 * statistics.median(values) for name, values in times.items()}
    load = ms["serial"] - ms["compute"]
    load_mb = len(payloads) * len(payloads[0]) / 1e6
    print(
        f"{len(payloads)} blocks ({load_mb:.1f} MB): compute {ms['compute']:.1f} ms,"
        f" serial {ms['serial']:.1f} ms, layer-wise {ms['layerwise']:.1f} ms",
        file=sys.stderr,
    )
    figures = {
        "model": args.model,
        "layers": runner.kv_cache.num_layers,
        "prefix_tokens": args.prefix_tokens,
        "new_tokens": args.new_tokens,
        "load_mb": round(load_mb, 1),
        "compute_ms": round(ms["compute"], 2),
        "serial_ms": round(ms["serial"], 2),
        "layerwise_ms": round(ms["layerwise"], 2),
        "hidden": round((ms["serial"] - ms["layerwise"]) / load, 3) if load > 0 else None,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
