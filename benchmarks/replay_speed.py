"""How long an offline trace replay takes: `weir replay` beside NVIDIA Dynamo 1.6.1's
`dynamo.replay.run_trace_replay`, on the same trace and configuration (8 workers, the KV
router, 64-token blocks, 16,384 blocks each), alternating, in one run.

Each replay runs as its own process, timed from start to exit: what a capacity planner
running many what-if replays waits for. Dynamo's needs a Python with `ai-dynamo==1.6.1`
and `ai-dynamo-runtime==1.6.1` (`--dynamo-python`; installed `--no-deps`, plus pydantic
<= 2.13.5, uvloop, msgspec, pyzmq, prometheus-client, transformers, tqdm); without it only
Weir's side runs. Both replays' own figures are kept, so the two are seen to replay the
same traffic (hit rate and mean TTFT within a few percent). Its per-decision log goes to
/dev/null.

Final JSON line: weir_s and dynamo_s (medians over `--rounds`), their rounds, the ratio
weir_s / dynamo_s, and each replay's hit rate and mean TTFT.

    python benchmarks/replay_speed.py [--trace T] [--rounds 3] [--dynamo-python /path/to/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
WORKERS, BLOCK_SIZE, NUM_BLOCKS = 8, 64, 16_384

DYNAMO = """
import json, sys
from dynamo.replay import run_trace_replay
report = run_trace_replay(
    sys.argv[1], num_workers=int(sys.argv[2]), router_mode="kv_router", trace_block_size=512,
    extra_engine_args={"engine": {"block_size": int(sys.argv[3]), "num_gpu_blocks": int(sys.argv[4])}},
)
print(json.dumps(report.summary), file=sys.stderr)
"""


def weir(trace: Path) -> tuple[float, dict[str, float]]:
    argv = [sys.executable, "-m", "orchestrator.cli.main", "replay", str(trace), "--workers", str(WORKERS)]
    argv += ["--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--router-mode", "kv"]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - started
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return seconds, {"hit_rate": figures["hit_rate"], "ttft_mean_ms": figures["ttft_mean_ms"]}


def dynamo(python: str, trace: Path) -> tuple[float, dict[str, float]]:
    argv = [python, "-c", DYNAMO, str(trace), str(WORKERS), str(BLOCK_SIZE), str(NUM_BLOCKS)]
    env = {**os.environ, "DYN_LOG": "error", "RUST_LOG": "error"}
    started = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    done.check_returncode()
    seconds = time.perf_counter() - started
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    hit_rate, ttft = summary["prefix_cache_reused_ratio"], summary["mean_ttft_ms"]
    return seconds, {"hit_rate": round(hit_rate, 4), "ttft_mean_ms": round(ttft, 2)}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dynamo-python", help="a Python with ai-dynamo 1.6.1 installed")
    args = parser.parse_args()
    weir_s: list[float] = []
    dynamo_s: list[float] = []
    weir_figures: dict[str, float] = {}
    dynamo_figures: dict[str, float] = {}
    for i in range(args.rounds):
        seconds, weir_figures = weir(args.trace)
        weir_s.append(round(seconds, 3))
        line = f"round {i + 1}: weir {seconds:.2f} s"
        if args.dynamo_python:
            seconds, dynamo_figures = dynamo(args.dynamo_python, args.trace)
            dynamo_s.append(round(seconds, 3))
            line += f", dynamo {seconds:.2f} s"
        print(line, file=sys.stderr)
    result: dict[str, object] = {
        "trace": args.trace.name,
        "workers": WORKERS,
        "weir_s": statistics.median(weir_s),
        "weir_rounds_s": weir_s,
        "weir": weir_figures,
    }
    if dynamo_s:
        result |= {
            "dynamo_s": statistics.median(dynamo_s),
            "dynamo_rounds_s": dynamo_s,
            "dynamo": dynamo_figures,
            "weir_over_dynamo": round(statistics.median(weir_s) / statistics.median(dynamo_s), 2),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
