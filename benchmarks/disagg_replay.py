"""Disaggregated against aggregated serving, in virtual time: the mocker's default timing
(NVIDIA Dynamo's polynomial), the KV router, the frontend's own disaggregation policy.

Three synthetic Mooncake-format workloads, Poisson arrivals, fresh prompts (no shared
prefixes, so caching does not decide the outcome):
- `short`: 200-1,000-token prompts, 100-300 output tokens;
- `long`: 6,000-12,000-token prompts, 50-150 output tokens;
- `mixed`: a steady decode load (400-800-token prompts, 300-600 output tokens) into which
  10,000-14,000-token prompts (50-100 output tokens) arrive twice a second.
Each runs, at equal worker counts (`--workers`, 4 by default), as `aggregated` (every worker
takes whole requests), `always` (half the workers prefill every request, half decode) and
`adaptive` (the same pools, disaggregating only when the policy predicts it pays).

Figures per run: mean and p99 TTFT, p99 inter-token latency pooled over every output token
(a disaggregated request's gap between its first and second token, the KV handover, counts
too), mean TPOT, and goodput (completed requests per second with TTFT <= `--slo-ttft-ms` and
TPOT <= `--slo-tpot-ms`). The checks of issue #12: on `mixed`, ITL p99 disaggregated /
aggregated (`mixed_itl_p99_ratio`, wanted <= 0.5); on each workload, adaptive goodput over the
better of the two fixed modes (`*_adaptive_goodput_ratio`, wanted >= 0.9).

    python benchmarks/disagg_replay.py        # about a minute

Ends with one JSON line of every run's figures and the ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.mocker.config import MockerConfig  # noqa: E402
from backends.mocker.replay import OfflineReplay, VirtualClock  # noqa: E402
from router.disagg import DisaggPolicy  # noqa: E402
from router.replay import TraceTokens, read_trace, summarize  # noqa: E402
from router.router import make_router  # noqa: E402

TRACE_BLOCK = 512
BLOCK = 64


def workload(name: str, seconds: float, rng: random.Random) -> list[dict[str, object]]:
    """(arrival ms, input tokens, output tokens) streams, merged, as trace lines."""
    streams = {
        "short": [(6.0, (200, 1000), (100, 300))],
        "long": [(0.6, (6000, 12000), (50, 150))],
        "mixed": [(4.0, (400, 800), (300, 600)), (2.0, (10000, 14000), (50, 100))],
    }[name]
    lines: list[dict[str, object]] = []
    next_id = 0
    for rate, (lo_in, hi_in), (lo_out, hi_out) in streams:
        t = 0.0
        while True:
            t += rng.expovariate(rate) * 1000
            if t > seconds * 1000:
                break
            n = rng.randint(lo_in, hi_in)
            blocks = -(-n // TRACE_BLOCK)
            lines.append(
                {
                    "timestamp": round(t, 3),
                    "input_length": n,
                    "output_length": rng.randint(lo_out, hi_out),
                    "hash_ids": list(range(next_id, next_id + blocks)),
                }
            )
            next_id += blocks
    return sorted(lines, key=lambda line: float(line["timestamp"]))  # type: ignore[arg-type]


Figures = dict[str, float | int | str | None]


def run(trace_path: Path, mode: str, workers: int, slo: dict[str, float]) -> Figures:
    trace, errors = read_trace(trace_path, TRACE_BLOCK)
    assert not errors, errors
    clock = VirtualClock()
    router = make_router("kv", BLOCK, clock=clock)
    config = MockerConfig(block_size=BLOCK, context_length=32_768)
    tokens = TraceTokens(TRACE_BLOCK, config.vocab_size)
    if mode == "aggregated":
        replay = OfflineReplay(router, config, workers, tokens, clock=clock)
    else:
        prefill_router = make_router("kv", BLOCK, clock=clock)
        half = workers // 2
        replay = OfflineReplay(
            router,
            config,
            workers - half,
            tokens,
            clock=clock,
            prefill_router=prefill_router,
            num_prefill_workers=half,
            disagg=DisaggPolicy(mode),  # type: ignore[arg-type]
        )
    f = summarize(replay.run(trace), mode, slo).figures
    keep = ("completed", "ttft_mean_ms", "ttft_p99_ms", "itl_p99_ms", "tpot_mean_ms", "goodput")
    figures = {k: f[k] for k in keep}
    figures["disaggregated_share"] = round(replay.disaggregated / len(trace), 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=120.0, help="trace length in simulated seconds")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    results: dict[str, object] = {"workers": args.workers, "slo": slo}
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("short", "long", "mixed"):
            path = Path(scratch) / f"{name}.jsonl"
            lines = workload(name, args.seconds, random.Random(f"{args.seed}-{name}"))
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            runs = {mode: run(path, mode, args.workers, slo) for mode in ("aggregated", "always", "adaptive")}
            for mode, figures in runs.items():
                print(f"{name:6} {mode:10} {figures}", file=sys.stderr)
            results[name] = runs
            best = max(float(runs["aggregated"]["goodput"] or 0), float(runs["always"]["goodput"] or 0))
            results[f"{name}_adaptive_goodput_ratio"] = (
                round(float(runs["adaptive"]["goodput"] or 0) / best, 3) if best else None
            )
        mixed = results["mixed"]
        assert isinstance(mixed, dict)
        agg_itl, disagg_itl = mixed["aggregated"]["itl_p99_ms"], mixed["always"]["itl_p99_ms"]
        results["mixed_itl_p99_ratio"] = round(disagg_itl / agg_itl, 3) if agg_itl and disagg_itl else None
    print(json.dumps(results))


if __name__ == "__main__":
    main()
