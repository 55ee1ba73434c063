"""Single-stream decode speed with n-gram speculative decoding, against the same engine without
it, on SmolLM2-135M-Instruct (float32, `--threads` torch threads), in one run.

Workloads where the output repeats the prompt, as n-gram (prompt lookup) speculation expects:
a function to be returned with one name changed (code editing), and a passage to be copied
out with its typos fixed; and an open-ended one (a short story), to show what drafts that
are seldom right cost. Each is a chat prompt through SmolLM2's template, decoded greedily
to `--max-tokens` (or its end of turn) by `Engine.step()` in-process, alternately with and
without `--speculative-config`-equivalent settings, `--rounds` times. Greedy output must be
the same token for token; the run fails otherwise.

Figures per workload: output tokens, decode tok/s of each engine (tokens after the first over
the time after the first, so prefill is left out), the speed-up, and the share of draft
tokens the model accepted. Medians over rounds. Final JSON line: those, and the speed-up's
minimum over the workloads.

    python benchmarks/speculative.py [--threads 1] [--max-tokens 192] [--rounds 2] [--k 4]

`--method mtp` measures DeepSeek-V3's multi-token-prediction drafts instead, on the tiny
one-layer checkpoint whose MTP layer is built to predict (`tiny.build_mtp_checkpoint`; no
released MTP checkpoint fits this machine), over random prompts. Its acceptance rate is the
figure; its speed-up is not DeepSeek-V3's, since there the MTP layer is one layer of 62 and
here it is one of two.

    python benchmarks/speculative.py --method mtp [--k 1] [--threads 1] [--max-tokens 192] [--rounds 2]
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.deepinfer.config import EngineConfig  # noqa: E402
from backends.deepinfer.engine import Engine  # noqa: E402
from backends.deepinfer.smollm2 import ensure_default_model  # noqa: E402
from backends.deepinfer.tiny import build_mtp_checkpoint  # noqa: E402
from orchestrator.frontend.preprocessor import Preprocessor  # noqa: E402
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest  # noqa: E402

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result
'''
PASSAGE = (
    "The river rises in the hills north of the town and flows south throught the old market "
    "square, where the first bridge was built in the twelfth century. For many years the bridge "
    "was the only crossing for fifty miles, and the town grew rich on the tolls it colected. "
    "When the railway arrived, a second bridge was built downstream, and the old one was closed "
    "to carts but kept open for people walking to the market on saturdays."
)
WORKLOADS = {
    "code edit": f"Rename the variable `total` to `running_sum` in this function. Reply with the whole "
    f"function and nothing else.\n\n```python\n{CODE}```",
    "copy with fixes": f"Copy out this passage exactly, fixing only its spelling mistakes:\n\n{PASSAGE}",
}
# What speculation costs where the output does not repeat the prompt: reported, not counted in
# `min_speedup`.
OPEN_ENDED = {"open-ended": "Write a short story about a lighthouse keeper who finds a message in a bottle."}


def decode(engine: Engine, token_ids: list[int], max_tokens: int, rid: str) -> tuple[list[int], float]:
    """Greedy output and the seconds from the first token to the last."""
    engine.add(
        WorkerRequest(
            request_id=rid,
            token_ids=token_ids,
            max_tokens=max_tokens,
            sampling=SamplingOptions(temperature=0.0),
        )
    )
    output: list[int] = []
    first = 0.0
    while engine.has_unfinished():
        for o in engine.step():
            if not output:
                first = time.perf_counter()
            output += [t.token_id for t in o.new_tokens]
    return output, time.perf_counter() - first


def measure(
    plain: Engine, spec: Engine, prompts: dict[str, list[int]], max_tokens: int, rounds: int
) -> dict[str, Any]:
    """Per workload: decode tok/s of each engine (medians over rounds, alternating), the
    speed-up and the share of drafts accepted; the run fails if an output differs."""
    figures: dict[str, Any] = {}
    n = 0
    for name, ids in prompts.items():
        plain_s: list[float] = []
        spec_s: list[float] = []
        drafted = spec.scheduler.num_draft_tokens
        accepted = spec.scheduler.num_accepted_tokens
        outputs: set[tuple[int, ...]] = set()
        for _ in range(rounds):
            for engine, times in ((plain, plain_s), (spec, spec_s)):
                n += 1
                output, seconds = decode(engine, ids, max_tokens, f"r{n}")
                outputs.add(tuple(output))
                times.append(seconds)
        if len(outputs) != 1:
            raise SystemExit(f"{name}: speculative decoding changed the greedy output")
        tokens = len(outputs.pop())
        plain_tps = (tokens - 1) / statistics.median(plain_s)
        spec_tps = (tokens - 1) / statistics.median(spec_s)
        drafts = spec.scheduler.num_draft_tokens - drafted
        figures[name] = {
            "prompt_tokens": len(ids),
            "output_tokens": tokens,
            "plain_tok_s": round(plain_tps, 2),
            "spec_tok_s": round(spec_tps, 2),
            "speedup": round(spec_tps / plain_tps, 3),
            "acceptance": round((spec.scheduler.num_accepted_tokens - accepted) / drafts, 3)
            if drafts
            else 0.0,
        }
        print(f"{name}: {json.dumps(figures[name])}", file=sys.stderr)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--method", choices=["ngram", "mtp"], default="ngram")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=None, help="num_speculative_tokens (ngram: 4, mtp: 1)")
    args = parser.parse_args()
    k = args.k or (1 if args.method == "mtp" else 4)
    torch.set_num_threads(args.threads)
    if args.method == "mtp":
        with tempfile.TemporaryDirectory() as tmp:
            model = build_mtp_checkpoint(Path(tmp) / "tiny-deepseek-v3-mtp")
            config: dict[str, Any] = {"model": str(model), "device": "cpu", "num_kv_blocks": 256}
            plain = Engine(EngineConfig(**config))
            spec = Engine(EngineConfig(**config, speculative_method="mtp", num_speculative_tokens=k))
            rng = random.Random(0)
            prompts = {f"random {i}": [rng.randrange(3, 500) for _ in range(32)] for i in range(4)}
            workloads = measure(plain, spec, prompts, args.max_tokens, args.rounds)
        accepted = [w["acceptance"] for w in workloads.values()]
        print(
            json.dumps(
                {
                    "model": "tiny-deepseek-v3-mtp",
                    "method": "mtp",
                    "threads": args.threads,
                    "k": k,
                    "workloads": workloads,
                    "identical": True,
                    "min_acceptance": min(accepted),
                    "mean_acceptance": round(statistics.mean(accepted), 3),
                }
            )
        )
        return
    model = ensure_default_model()
    pre = Preprocessor.load(model)
    config = {"model": str(model), "device": "cpu", "dtype": "float32", "num_kv_blocks": 256}
    plain = Engine(EngineConfig(**config))
    spec = Engine(EngineConfig(**config, num_speculative_tokens=k))
    prompts = {
        name: pre.encode(pre.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)
        for name, text in {**WORKLOADS, **OPEN_ENDED}.items()
    }
    workloads = measure(plain, spec, prompts, args.max_tokens, args.rounds)
    figures: dict[str, Any] = {"model": model.name, "threads": args.threads, "k": k}
    figures["workloads"] = workloads
    figures["identical"] = True
    figures["min_speedup"] = min(workloads[name]["speedup"] for name in WORKLOADS)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
