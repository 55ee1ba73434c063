"""`weir bench`: one workload, one load (or a sweep of loads), against an OpenAI-compatible
server and optionally the bare engine behind it, reported as the field reports serving.

    weir bench --url http://127.0.0.1:8000 --concurrency 1,4,16 --input-tokens 256 \\
        --output-tokens 128 --slo ttft=500,tpot=50 --output bench-out

prints a Markdown table of TTFT, TPOT, ITL and E2E percentiles, throughput and goodput per
load, then one JSON line. `--direct` runs the same requests against the engine with nothing in
front of it (another OpenAI URL, or a Weir worker's request-plane address) in the same run,
and adds Weir-over-direct ratios. Definitions are in `orchestrator/bench/stats.py` and
docs/bench.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import socket
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from orchestrator.bench.load import Decode, Encode, Load, run_load
from orchestrator.bench.report import Point, markdown, ratios, write_csv, write_json
from orchestrator.bench.stats import Slo, errors_by_type, summarize
from orchestrator.bench.targets import OpenAITarget, Target, WorkerTarget
from orchestrator.bench.workloads import (
    Lengths,
    Session,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
    shifted,
    trace_workload,
)
from orchestrator.cli.options import add_plane_security, plane_security
from orchestrator.runtime.progress import progress_bar

WORKLOADS = ("random", "shared-prefix", "multi-turn", "trace")
WEIR, DIRECT = "weir", "direct"


def register(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = METRICS_HELP
    target = parser.add_argument_group("targets")
    target.add_argument("--url", required=True, help="the OpenAI-compatible server to measure")
    target.add_argument(
        "--direct",
        metavar="URL|HOST:PORT",
        help="also measure the bare engine behind --url, same requests, same run: an OpenAI URL "
        "(http://...) or a Weir worker's request-plane address (weir status lists them; "
        "weir serve prints its own)",
    )
    target.add_argument("--model", help="model name to ask for (default: the server's first model)")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="(env OPENAI_API_KEY)")
    target.add_argument("--timeout", type=float, default=600.0, help="per request, seconds (default 600)")
    add_plane_security(parser, serving=False)

    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="random")
    work.add_argument(
        "--num-requests",
        type=_at_least_one,
        help="requests (multi-turn: sessions); default 200, a trace's first N (default all)",
    )
    work.add_argument(
        "--input-tokens",
        type=Lengths.parse,
        default=Lengths.parse("256"),
        metavar="LEN",
        help="prompt tokens (shared-prefix: after the prefix; multi-turn: new tokens per turn): "
        "N, uniform:MIN,MAX or normal:MEAN,STD (default 256)",
    )
    work.add_argument(
        "--output-tokens",
        type=Lengths.parse,
        default=Lengths.parse("128"),
        metavar="LEN",
        help="tokens to generate, same forms (default 128)",
    )
    work.add_argument(
        "--prefix-groups", type=_at_least_one, default=8, help="shared-prefix: groups (default 8)"
    )
    work.add_argument(
        "--prefix-tokens", type=_at_least_one, default=1024, help="shared-prefix: tokens (default 1024)"
    )
    work.add_argument(
        "--turns", type=_at_least_one, default=4, help="multi-turn: turns per session (default 4)"
    )
    work.add_argument("--trace", metavar="JSONL", help="trace: a Mooncake-format trace")
    work.add_argument(
        "--scale",
        type=_at_least_one,
        default=1,
        help="trace: divide input lengths by k, blocks become 512/k tokens (default 1)",
    )
    work.add_argument(
        "--trace-block-size",
        type=_at_least_one,
        default=512,
        help="trace: tokens per hash id (Mooncake's: 512)",
    )
    work.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer.json (or its directory) of the served model: needed for chat prompts and to "
        "re-tokenize replies in multi-turn completions (default: the --direct worker's, if any)",
    )
    work.add_argument(
        "--vocab-size",
        type=_at_least_one,
        help="prompt ids fall below this (default: the tokenizer's, else 32000)",
    )
    work.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default 0)")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=_int_list,
        metavar="N[,N...]",
        help="closed loop: sessions in flight; a list sweeps (default 1; with --request-rate, a cap)",
    )
    load.add_argument(
        "--request-rate",
        type=_float_list,
        metavar="R[,R...]",
        help="open loop: Poisson arrivals per second; a list sweeps",
    )
    load.add_argument(
        "--trace-speedup",
        type=_float_list,
        metavar="S[,S...]",
        help="trace: divide timestamps by S (default 1); a list sweeps",
    )
    load.add_argument("--warmup", type=int, default=0, help="warm-up requests per target, not measured")
    load.add_argument(
        "--repeats", type=_at_least_one, default=1, help="runs per load; medians and ranges reported"
    )

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0, help="(default 0: greedy)")
    sampling.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let the model stop early (default: ignore_eos, so output lengths are exact)",
    )
    sampling.add_argument(
        "--extra-body", type=json.loads, default={}, metavar="JSON", help="merged into each request body"
    )

    out = parser.add_argument_group("results")
    out.add_argument("--slo", type=Slo.parse, metavar="ttft=MS,tpot=MS,e2e=MS", help="goodput targets")
    out.add_argument(
        "--output",
        metavar="DIR",
        help="write result.json, requests.csv and PNG plots (plots need matplotlib: "
        "pip install 'weir[plots]')",
    )
    parser.set_defaults(run=run)


METRICS_HELP = """metrics (docs/bench.md):
  TTFT   request sent to the first chunk carrying output
  TPOT   per request (e2e - TTFT) / (output tokens - 1), vLLM's definition (aiperf's "ITL")
  ITL    every gap between consecutive output chunks, pooled over requests
  E2E    request sent to the end of its stream
  percentiles linearly interpolated; throughput over first send to last finish;
  goodput: requests per second meeting every --slo target (DistServe); good: their fraction
"""


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("every value must be at least 1")
    return values


def _float_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",")]
    if any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError("every value must be positive")
    return values


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        loads = _loads(args)
    except ValueError as exc:
        print(f"weir bench: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_bench(args, loads))
    except (ValueError, OSError) as exc:
        print(f"weir bench: {exc}", file=sys.stderr)
        return 2


def _loads(args: argparse.Namespace) -> list[Load]:
    if args.workload == "trace":
        if not args.trace:
            raise ValueError("--workload trace needs --trace FILE")
        if args.request_rate:
            raise ValueError("a trace brings its own arrival times: use --trace-speedup, not --request-rate")
        cap = _single(args.concurrency, "--concurrency (a cap under a trace)")
        return [Load(concurrency=cap, trace_speedup=s, seed=args.seed) for s in args.trace_speedup or [1.0]]
    if args.trace_speedup:
        raise ValueError("--trace-speedup goes with --workload trace")
    if args.request_rate:
        cap = _single(args.concurrency, "--concurrency (a cap under --request-rate)")
        return [Load(concurrency=cap, rate=r, seed=args.seed) for r in args.request_rate]
    return [Load(concurrency=c, seed=args.seed) for c in args.concurrency or [1]]


def _single(values: list[int] | None, what: str) -> int | None:
    if values and len(values) > 1:
        raise ValueError(f"{what} takes one value")
    return values[0] if values else None


async def _bench(args: argparse.Namespace, loads: list[Load]) -> int:
    targets: list[Target] = [_openai(WEIR, args.url, args)]
    if args.direct:
        if args.direct.startswith(("http://", "https://")):
            targets.append(_openai(DIRECT, args.direct, args))
        else:
            security = plane_security(args, serving=False)
            targets.append(WorkerTarget(DIRECT, args.direct, security=security, temperature=args.temperature))
    try:
        described = {t.name: await t.describe() for t in targets}
        encode, decode, vocab_size = await _tokenizer(args, targets)
        if args.endpoint == "chat" and decode is None:
            raise ValueError("chat prompts are text: give --tokenizer (the served model's tokenizer.json)")
        sessions = _workload(args, vocab_size)
        warmup = random_workload(
            args.warmup, args.input_tokens, args.output_tokens, vocab_size, args.seed + 1
        )
        config = _configuration(args, described, sessions, vocab_size)
        points = await _measure(args, loads, targets, sessions, warmup, vocab_size, encode, decode)
    finally:
        for t in targets:
            await t.close()
    config["load_average_after"] = list(os.getloadavg())
    result: dict[str, Any] = {"configuration": config, "points": [p.as_json() for p in points]}
    if args.direct:
        result["ratios"] = ratios(points, WEIR, DIRECT)
    print(markdown(points, result.get("ratios", []), f"{WEIR}/{DIRECT}"))
    if args.output:
        _write(Path(args.output), result, points)
    print(json.dumps(_summary_line(result)))
    sys.stdout.flush()
    # Failed requests are results (counted by type above); a load where none completed is
    # a broken setup, which a script running the benchmark should not mistake for figures.
    return 1 if any(not p.figures["completed"] for p in points) else 0


def _openai(name: str, url: str, args: argparse.Namespace) -> OpenAITarget:
    return OpenAITarget(
        name,
        url,
        args.model,
        args.endpoint,
        api_key=args.api_key,
        sampling={"temperature": args.temperature},
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        timeout_s=args.timeout,
    )


async def _tokenizer(
    args: argparse.Namespace, targets: list[Target]
) -> tuple[Encode | None, Decode | None, int]:
    from tokenizers import Tokenizer

    raw: bytes | None = None
    if args.tokenizer:
        path = Path(args.tokenizer)
        raw = (path / "tokenizer.json" if path.is_dir() else path).read_bytes()
    else:
        for t in targets:
            if isinstance(t, WorkerTarget):
                raw = await t.tokenizer_json()
    if raw is None:
        return None, None, args.vocab_size or 32_000
    tokenizer = Tokenizer.from_str(raw.decode())

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    return encode, decode, args.vocab_size or tokenizer.get_vocab_size()


def _workload(args: argparse.Namespace, vocab_size: int) -> list[Session]:
    if args.workload == "trace":
        return trace_workload(args.trace, args.scale, vocab_size, args.num_requests, args.trace_block_size)
    n, inputs, outputs, seed = args.num_requests or 200, args.input_tokens, args.output_tokens, args.seed
    if args.workload == "shared-prefix":
        return shared_prefix_workload(
            n, args.prefix_groups, args.prefix_tokens, inputs, outputs, vocab_size, seed
        )
    if args.workload == "multi-turn":
        return multi_turn_workload(n, args.turns, inputs, outputs, vocab_size, seed)
    return random_workload(n, inputs, outputs, vocab_size, seed)


async def _measure(
    args: argparse.Namespace,
    loads: list[Load],
    targets: list[Target],
    sessions: list[Session],
    warmup: list[Session],
    vocab_size: int,
    encode: Encode | None,
    decode: Decode | None,
) -> list[Point]:
    points = {(t.name, load): Point(t.name, load) for load in loads for t in targets}
    turns = sum(len(s.turns) for s in sessions)
    total = turns * len(loads) * len(targets) * args.repeats + len(warmup) * len(targets)
    run_index = 0
    with progress_bar(total, "bench", "req") as bar:

        def tick(_: object) -> None:
            bar.update()

        async def one(target: Target, workload: list[Session], load: Load) -> tuple[list[Any], float]:
            # Every run gets its own token ids (same lengths, same sharing), so no run is served
            # from a cache an earlier run filled.
            nonlocal run_index
            run_index += 1
            return await run_load(
                shifted(workload, run_index, vocab_size),
                target,
                load,
                vocab_size=vocab_size,
                encode=encode,
                decode=decode,
                on_record=tick,
            )

        for target in targets:
            if warmup:
                await one(target, warmup, Load(concurrency=loads[0].concurrency or 1, seed=args.seed))
        for load in loads:
            for repeat in range(args.repeats):
                # Alternate which target goes first, so a drifting machine favours neither.
                order = targets if repeat % 2 == 0 else targets[::-1]
                for target in order:
                    records, duration = await one(target, sessions, load)
                    point = points[(target.name, load)]
                    point.runs.append(summarize(records, duration, args.slo))
                    point.records.append(records)
                    point.errors.update(errors_by_type(records))
    return list(points.values())


def _configuration(
    args: argparse.Namespace, described: dict[str, Any], sessions: list[Session], vocab_size: int
) -> dict[str, Any]:
    try:
        weir_version = version("weir")
    except PackageNotFoundError:
        weir_version = "unknown"
    options = {
        k: _jsonable(v) for k, v in vars(args).items() if k not in ("run", "api_key", "cluster_secret")
    }
    return {
        "weir_version": weir_version,
        "command": ["weir", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else sys.argv,
        "options": options,
        "workload": {
            "kind": args.workload,
            "seed": args.seed,
            "sessions": len(sessions),
            "requests": sum(len(s.turns) for s in sessions),
            "vocab_size": vocab_size,
        },
        "targets": described,
        "slo": str(args.slo) if args.slo else None,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_before": list(os.getloadavg()),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _jsonable(value: object) -> object:
    return value if isinstance(value, str | int | float | bool | list | dict | type(None)) else str(value)


def _write(out: Path, result: dict[str, Any], points: list[Point]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "result.json", result)
    write_csv(out / "requests.csv", points)
    try:
        from orchestrator.bench.plots import draw
    except ImportError:
        print(
            "weir bench: no plots: matplotlib is not installed (pip install 'weir[plots]')", file=sys.stderr
        )
        return
    for path in draw(out, points):
        print(f"wrote {path}", file=sys.stderr)


def _summary_line(result: dict[str, Any]) -> dict[str, Any]:
    """The last line: what a script compares, without the per-request detail or the server
    card (those are in result.json)."""
    config = result["configuration"]
    keep: tuple[str, ...] = (
        "target", "load", "completed", "failed", "request_throughput", "output_token_throughput"
    )  # fmt: skip
    keep += tuple(f"{m}_{q}_ms" for m in ("ttft", "tpot", "itl", "e2e") for q in ("mean", "p50", "p99"))
    keep += ("goodput", "good_fraction", "cache_hit_rate", "errors")
    line: dict[str, Any] = {
        "bench": "weir",
        "workload": config["workload"],
        "slo": config["slo"],
        "points": [{k: p[k] for k in keep if k in p} for p in result["points"]],
    }
    if "ratios" in result:
        line["ratios"] = result["ratios"]
    return line
