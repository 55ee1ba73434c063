"""`weir replay TRACE.jsonl`: replay a Mooncake-format trace.

Offline (the default): the real router against `--workers` mocker engines in virtual time,
so a 4,000-request trace takes seconds; it prints TTFT, time per output token, inter-token
and end-to-end latency percentiles, throughput, prefix hit rate and the per-worker spread
(and goodput, with `--slo`), then one JSON line of the figures. `--prefill-workers P
--decode-workers D` replays disaggregated serving instead, with the frontend's own decision
(`--disaggregation`). Online (`--url`): weir bench's trace workload against a running server, the trace's
requests sent in real time (divided by `--trace-speedup`), with bench's table and JSON line.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

from backends.deepinfer.block_pool import EVICTIONS
from orchestrator.cli.options import (
    add_disaggregation_arguments,
    add_old_spelling,
    add_router_arguments,
    disagg_policy,
    router_params,
)
from orchestrator.runtime.progress import progress_bar
from router.replay import RequestRecord, TraceRequest, TraceTokens, read_trace, report, summarize
from router.router import MODES

# Old spelling -> the name the other commands use for the same thing; kept for one release.
RENAMED_FLAGS = {
    "--model": "--served-model-name",
    "--speedup": "--trace-speedup",
    "--router": "--router-mode",
    "--overlap-weight": "--kv-overlap-weight",
    "--temperature": "--router-temperature",
    "--seed": "--router-seed",
    "--cache-blocks": "--num-blocks",
    "--output": "--output-file",
}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace", help="Mooncake-format JSONL: timestamp (ms), input_length, output_length, hash_ids"
    )
    parser.add_argument("--url", help="replay online against this frontend (e.g. http://127.0.0.1:8000)")
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="online: the model name to ask for (default: the frontend's first model)",
    )
    parser.add_argument(
        "--trace-speedup", type=float, default=1.0, help="online: divide trace time by this (default 1)"
    )
    parser.add_argument("--workers", type=int, default=8, help="offline: mocker workers (default 8)")
    routing = add_router_arguments(parser, MODES[:5], "kv", default_seed=0)
    disagg = parser.add_argument_group(
        "offline: disaggregated prefill and decode pools, in place of --workers"
    )
    disagg.add_argument("--prefill-workers", type=int, default=0, help="prefill mockers (default 0)")
    disagg.add_argument("--decode-workers", type=int, default=0, help="decode mockers (default 0)")
    add_disaggregation_arguments(routing, "offline, with prefill and decode pools, as the frontend decides")
    parser.add_argument(
        "--slo",
        type=_slo,
        metavar="ttft=MS,tpot=MS,e2e=MS",
        help="offline: targets for goodput (requests per second that met all of them), any subset",
    )
    parser.add_argument("--kv-event-delay-ms", type=float, default=0.0, help="offline: KV event latency (ms)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per engine KV block (default 64)")
    parser.add_argument(
        "--num-blocks", type=int, default=16_384, help="offline: KV blocks per mocker worker (default 16384)"
    )
    parser.add_argument(
        "--kv-eviction",
        choices=EVICTIONS,
        default="lru",
        help="offline: which cached blocks each mocker evicts first, as DeepInfer's --kv-eviction "
        "(default lru)",
    )
    tiers = parser.add_argument_group("offline: KV tiers below each mocker's device cache (kvbm)")
    tiers.add_argument(
        "--host-cache-blocks", type=int, default=0, help="G2 host blocks per worker (default 0)"
    )
    tiers.add_argument(
        "--disk-cache-blocks", type=int, default=0, help="G3 disk blocks per worker (default 0)"
    )
    tiers.add_argument(
        "--shared-cache-blocks", type=int, default=0, help="G4 blocks shared by all workers (default 0)"
    )
    tiers.add_argument(
        "--kv-bytes-per-token",
        type=int,
        help="KV bytes per token, for the time a block takes to load (default 131072: Llama-3-8B in bf16)",
    )
    parser.add_argument(
        "--trace-block-size", type=int, default=512, help="tokens per trace hash id (default 512)"
    )
    parser.add_argument("--vocab-size", type=int, default=32_000, help="synthetic token ids fall below this")
    parser.add_argument("--max-requests", type=int, help="replay only the first N requests")
    parser.add_argument("--output-file", metavar="FILE", help="also write the final JSON line to this file")
    for old, new in RENAMED_FLAGS.items():
        add_old_spelling(parser, old, new)
    parser.set_defaults(run=run)


def _slo(text: str) -> dict[str, float]:
    """`ttft=500,tpot=50` -> {"ttft": 500.0, "tpot": 50.0}, as weir bench reads --slo."""
    from orchestrator.bench.stats import Slo  # numpy: only for a command line that asks

    try:
        slo = Slo.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    targets = {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms, "e2e": slo.e2e_ms}
    return {name: ms for name, ms in targets.items() if ms is not None}


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.url:
        return _online(args)
    if (args.prefill_workers > 0) != (args.decode_workers > 0) or min(
        args.prefill_workers, args.decode_workers
    ) < 0:
        sys.stderr.write("weir replay: --prefill-workers and --decode-workers go together, each at least 1\n")
        return 2
    if args.trace_block_size % args.block_size:
        size, trace_size = args.block_size, args.trace_block_size
        sys.stderr.write(f"weir replay: --block-size {size} must divide --trace-block-size {trace_size}\n")
        return 2
    try:
        trace, errors = read_trace(args.trace, args.trace_block_size)
    except OSError as exc:
        print(f"weir replay: cannot read {args.trace}: {exc}", file=sys.stderr)
        return 2
    for error in errors:
        print(error, file=sys.stderr)
    trace = trace[: args.max_requests] if args.max_requests else trace
    if not trace:
        print("weir replay: the trace holds no valid request", file=sys.stderr)
        return 2
    tokens = TraceTokens(args.trace_block_size, args.vocab_size)
    started = time.perf_counter()
    with progress_bar(len(trace), "replay", "req") as bar:

        def finished(_: RequestRecord) -> None:
            bar.update()

        records, disaggregated = _offline(args, trace, tokens, finished)
    label = args.router_mode if args.router_mode != "kv" or not args.no_kv_events else "kv-approx"
    print(f"replayed {len(trace)} requests in {time.perf_counter() - started:.1f} s wall", file=sys.stderr)
    summary = summarize(records, label, args.slo)
    if args.prefill_workers:
        summary.figures["disaggregation"] = args.disaggregation
        summary.figures["disaggregated_share"] = round(disaggregated / len(trace), 4)
    report(summary, args.output_file)
    return 0


def _online(args: argparse.Namespace) -> int:
    """The trace against a running server is `weir bench --workload trace`: one online driver."""
    if args.output_file:
        print(
            "weir replay: --output-file is offline only; online, use weir bench --output DIR", file=sys.stderr
        )
        return 2
    from orchestrator.cli.main import main as weir

    argv = ["bench", "--url", args.url, "--workload", "trace", "--trace", args.trace]
    argv += ["--trace-speedup", str(args.trace_speedup), "--trace-block-size", str(args.trace_block_size)]
    argv += ["--vocab-size", str(args.vocab_size)]
    if args.served_model_name:
        argv += ["--model", args.served_model_name]
    if args.max_requests:
        argv += ["--num-requests", str(args.max_requests)]
    return weir(argv)


def _offline(
    args: argparse.Namespace,
    trace: list[TraceRequest],
    tokens: TraceTokens,
    on_finish: Callable[[RequestRecord], None],
) -> tuple[list[RequestRecord], int]:
    """The records, and how many requests had their prefill on the prefill pool."""
    from backends.mocker.config import MockerConfig
    from backends.mocker.replay import OfflineReplay, VirtualClock
    from router.router import make_router

    clock = VirtualClock()
    router = make_router(args.router_mode, args.block_size, clock=clock, **router_params(args))
    longest = max(r.input_length + r.output_length for r in trace)
    config = MockerConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        vocab_size=args.vocab_size,
        context_length=max(longest, MockerConfig().context_length),
        host_cache_blocks=args.host_cache_blocks,
        disk_cache_blocks=args.disk_cache_blocks,
        kv_eviction=args.kv_eviction,
    )
    if args.kv_bytes_per_token is not None:
        config.kv_bytes_per_token = args.kv_bytes_per_token
    prefill_router = None
    if args.prefill_workers:
        prefill_router = make_router(args.router_mode, args.block_size, clock=clock, **router_params(args))
    replay = OfflineReplay(
        router,
        config,
        args.decode_workers or args.workers,
        tokens,
        args.kv_event_delay_ms,
        clock,
        args.shared_cache_blocks,
        prefill_router,
        args.prefill_workers,
        disagg_policy(args),
    )
    records = replay.run(trace, on_finish)
    return records, replay.disaggregated
