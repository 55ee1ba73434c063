"""DeepInfer on a multi-turn chat whose KV outgrows the engine's cache: without and with the
host-memory KV tier (G2).

A chat resends its whole history every turn, so from the second turn on most of each prompt
is KV the engine computed before. The engine's own cache (G1) keeps it only while it fits:
here all conversations together hold `kv_over_g1` (>= 10 with the defaults) times what G1
holds, G1 being just large enough for the longest request, so by the time a conversation comes
back its blocks are long gone and G1 alone recomputes the full history. With the host tier,
every completed block is written through to host memory (sized to hold all of them) and
loaded back instead of recomputed. The figure to watch is `ttft_ratio`, mean time to first
token without / with the host tier: what the tier saves on prefill, net of its copies in and
out.

Workload: `--conversations` chats of `--turns` turns, interleaved round-robin (turn 1 of every
chat, then turn 2, ...). Each turn appends `--user-tokens` random token ids to the history,
asks for `--output-tokens` greedy tokens (ignore_eos) and appends them to the history, so the
next prompt is the whole history plus a new message. Requests go one at a time (closed loop,
concurrency 1), so time to first token is prefill (plus onboarding), not queueing. Both
configurations run in this process, one after the other, on the same messages in the same
order, each after one warm-up request; their greedy outputs must be token-identical (asserted).

    python benchmarks/kvbm_multiturn.py                 # SmolLM2-135M-Instruct, a few minutes
    python benchmarks/kvbm_multiturn.py --model tiny    # a tiny random Llama, seconds

Ends with one JSON line: the sizes (`num_kv_blocks`, `g1_tokens`, `total_kv_tokens`,
`kv_over_g1`, `host_cache_gb`), then per configuration (`g1_`: engine cache only, `g2_`: with
the host tier) `ttft_mean_ms`, `ttft_p50_ms`, `prefill_tokens` (prompt tokens computed, i.e.
minus cached ones), `cached_tokens_mean` (per request) and `wall_s`; then `ttft_ratio` and
`outputs_identical`.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models import MODELS, deepinfer_model  # noqa: E402

from backends.deepinfer.config import EngineConfig  # noqa: E402
from backends.deepinfer.engine import Engine  # noqa: E402
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest  # noqa: E402

GREEDY = SamplingOptions(temperature=0.0)
TOKEN_IDS = (3, 500)  # random message tokens: valid for both models' vocabularies
WARMUP_TOKENS = 32
HOST_SLACK = 1.25  # host tier size over the blocks the workload writes


@dataclass(slots=True)
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    output: list[int]


def serve(engine: Engine, request_id: str, tokens: list[int], max_tokens: int) -> Turn:
    """One request alone on the engine, stepped until it finishes."""
    started = time.perf_counter()
    engine.add(
        WorkerRequest(
            request_id=request_id, token_ids=tokens, max_tokens=max_tokens, ignore_eos=True, sampling=GREEDY
        )
    )
    ttft: float | None = None
    while True:
        for out in engine.step():
            if ttft is None:
                ttft = time.perf_counter() - started
            if out.finished:
                seq = out.seq
                return Turn(
                    seq.num_prompt_tokens, seq.num_cached_tokens, ttft, seq.token_ids[seq.num_prompt_tokens :]
                )


def chat(
    engine: Engine, messages: list[list[list[int]]], output_tokens: int
) -> tuple[list[list[Turn]], float]:
    """Every conversation's turns, round-robin, each prompt the conversation's history so far;
    the turns as `[turn][conversation]` and the wall time of the whole workload."""
    rng = random.Random(-1)
    serve(engine, "warmup", [rng.randrange(*TOKEN_IDS) for _ in range(WARMUP_TOKENS)], output_tokens)
    histories: list[list[int]] = [[] for _ in messages]
    turns: list[list[Turn]] = []
    started = time.perf_counter()
    for t in range(len(messages[0])):
        turns.append([])
        for c, history in enumerate(histories):
            history += messages[c][t]
            turn = serve(engine, f"c{c}t{t}", list(history), output_tokens)
            history += turn.output
            turns[t].append(turn)
    return turns, time.perf_counter() - started


def figures(prefix: str, turns: list[list[Turn]], wall_s: float) -> dict[str, float | int]:
    flat = [turn for by_turn in turns for turn in by_turn]
    ttfts = [turn.ttft_s * 1e3 for turn in flat]
    return {
        f"{prefix}_ttft_mean_ms": statistics.mean(ttfts),
        f"{prefix}_ttft_p50_ms": statistics.median(ttfts),
        f"{prefix}_prefill_tokens": sum(turn.prompt_tokens - turn.cached_tokens for turn in flat),
        f"{prefix}_cached_tokens_mean": statistics.fmean(turn.cached_tokens for turn in flat),
        f"{prefix}_wall_s": wall_s,
    }


def first_difference(a: list[list[Turn]], b: list[list[Turn]]) -> str | None:
    for t, (turns_a, turns_b) in enumerate(zip(a, b, strict=True)):
        for c, (x, y) in enumerate(zip(turns_a, turns_b, strict=True)):
            if x.output != y.output:
                return f"conversation {c}, turn {t + 1}: {x.output} != {y.output}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--conversations", type=int, default=12, help="12: the KV is 11x G1 by default")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-tokens", type=int, default=96, help="new tokens in each user message")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens generated per turn")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--host-cache-gb", type=float, help="default: all the workload's blocks, plus 25%%")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (shared machine: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    bs, n_conv, n_turns = args.block_size, args.conversations, args.turns
    user, answer = args.user_tokens, args.output_tokens
    rng = random.Random(args.seed)
    messages = [
        [[rng.randrange(*TOKEN_IDS) for _ in range(user)] for _ in range(n_turns)] for _ in range(n_conv)
    ]
    longest = n_turns * user + (n_turns - 1) * answer  # the last turn's prompt
    num_kv_blocks = -(-(longest + answer) // bs) + 2  # G1: the longest request and its output
    final_tokens = longest + answer  # one conversation's KV after its last turn
    total_kv = n_conv * final_tokens
    kv_over_g1 = total_kv / (num_kv_blocks * bs)
    print(
        f"{n_conv} conversations x {n_turns} turns of {user} + {answer} tokens; longest prompt {longest}; "
        f"G1 {num_kv_blocks} blocks = {num_kv_blocks * bs} tokens; all KV {total_kv} tokens = "
        f"{kv_over_g1:.1f}x G1"
    )
    if kv_over_g1 < 10:
        print(f"warning: the KV is only {kv_over_g1:.1f}x G1 (the benchmark wants >= 10)", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        model = deepinfer_model(args.model, Path(tmp))

        def engine(host_cache_gb: float) -> Engine:
            return Engine(
                EngineConfig(
                    model=str(model),
                    device="cpu",
                    block_size=bs,
                    num_kv_blocks=num_kv_blocks,
                    host_cache_gb=host_cache_gb,
                )
            )

        g1 = engine(0.0)
        block_bytes = g1.runner.kv_cache.block_bytes
        g1_turns, g1_wall = chat(g1, messages, answer)
        del g1
        gc.collect()

        host_blocks = n_conv * -(-final_tokens // bs) + -(-(WARMUP_TOKENS + answer) // bs)
        host_cache_gb = args.host_cache_gb or HOST_SLACK * host_blocks * block_bytes / 2**30
        g2_turns, g2_wall = chat(engine(host_cache_gb), messages, answer)

    difference = first_difference(g1_turns, g2_turns)
    assert difference is None, f"greedy outputs differ with the host tier: {difference}"

    print(f"{'turn':>4}{'prompt':>8}{'G1 TTFT ms':>12}{'G2 TTFT ms':>12}{'G2 cached':>11}")
    for t, (by_turn_g1, by_turn_g2) in enumerate(zip(g1_turns, g2_turns, strict=True)):
        print(
            f"{t + 1:>4}{statistics.mean(x.prompt_tokens for x in by_turn_g1):>8.0f}"
            f"{statistics.mean(x.ttft_s for x in by_turn_g1) * 1e3:>12.1f}"
            f"{statistics.mean(x.ttft_s for x in by_turn_g2) * 1e3:>12.1f}"
            f"{statistics.mean(x.cached_tokens for x in by_turn_g2):>11.0f}"
        )
    summary: dict[str, Any] = {
        "model": args.model,
        "conversations": n_conv,
        "turns": n_turns,
        "user_tokens": user,
        "output_tokens": answer,
        "block_size": bs,
        "threads": args.threads,
        "num_kv_blocks": num_kv_blocks,
        "g1_tokens": num_kv_blocks * bs,
        "total_kv_tokens": total_kv,
        "kv_over_g1": kv_over_g1,
        "block_bytes": block_bytes,
        "host_cache_gb": host_cache_gb,
        **figures("g1", g1_turns, g1_wall),
        **figures("g2", g2_turns, g2_wall),
    }
    summary["ttft_ratio"] = summary["g1_ttft_mean_ms"] / summary["g2_ttft_mean_ms"]
    summary["outputs_identical"] = True
    print(
        f"mean TTFT {summary['g1_ttft_mean_ms']:.1f} ms without the host tier, "
        f"{summary['g2_ttft_mean_ms']:.1f} ms with it: {summary['ttft_ratio']:.2f}x"
    )
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
