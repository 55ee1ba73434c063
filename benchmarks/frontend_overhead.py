"""Frontend CPU per streamed request: how much the HTTP edge costs on top of the workers.

Four processes on 127.0.0.1, so the CPU figure is the frontend's alone:
  - etcd and NATS (real servers on free ports),
  - workers: 2 mocker engines at near-zero delay behind `WorkerHost`s (request plane over TCP),
  - the frontend (`run_frontend`, uvicorn + uvloop + httptools), finding workers in etcd,
  - the client: an httpx load generator, `--concurrency` streams at a time.

Each request is a streamed chat completion of exactly `--output-tokens` tokens (ignore_eos).
The frontend's CPU time (user + system, from /proc/<pid>/stat) is read before and after the
measured run, after a warm-up, and divided by the number of requests.

    python benchmarks/frontend_overhead.py            # 1,000 requests, concurrency 16, 16 tokens

Prints a summary and ends with one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "bench-model"
NAMESPACE = "bench"
PROMPT = "Explain in one sentence why the quick brown fox jumps over the lazy dog."


# ---------------------------------------------------------------------------- roles


async def _workers(args: argparse.Namespace) -> None:
    from backends.mocker.config import MockerConfig
    from backends.mocker.engine import MockerEngine
    from orchestrator.frontend.preprocessor import Preprocessor
    from orchestrator.runtime.discovery import make_discovery
    from orchestrator.runtime.events import make_event_plane
    from orchestrator.runtime.worker_host import WorkerHost, serve_workers

    vocab = Preprocessor.load(args.model_dir).vocab_size
    discovery = make_discovery(args.etcd, NAMESPACE)
    events = make_event_plane(args.nats)
    config = MockerConfig(model_name=MODEL, model_path=args.model_dir, speedup=args.speedup, vocab_size=vocab)
    hosts = [
        WorkerHost(MockerEngine(config), discovery, events, NAMESPACE, instance_id=f"bench-worker-{i}")
        for i in range(args.workers)
    ]
    try:
        await serve_workers(hosts)
    finally:
        await discovery.close()
        await events.close()


async def _frontend(args: argparse.Namespace) -> None:
    from orchestrator.frontend.config import FrontendConfig
    from orchestrator.frontend.server import run_frontend
    from orchestrator.runtime.discovery import make_discovery
    from orchestrator.runtime.events import make_event_plane

    discovery = make_discovery(args.etcd, NAMESPACE)
    events = make_event_plane(args.nats)
    config = FrontendConfig(port=args.port, namespace=NAMESPACE, router_mode=args.router_mode)
    try:
        await run_frontend(config, discovery, events)
    finally:
        await discovery.close()
        await events.close()


async def _client(args: argparse.Namespace) -> None:
    """Runs `--requests` streams, `--concurrency` at a time; prints one JSON line of samples."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": args.output_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    ttft: list[float] = []
    e2e: list[float] = []
    chunks: list[int] = []
    errors = 0
    todo = iter(range(args.requests))
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def loop() -> None:
            nonlocal errors
            for _ in todo:
                start = time.perf_counter()
                first: float | None = None
                count = 0
                done = False
                async with client.stream("POST", url, json=body) as response:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                        elif '"content"' in line:
                            first = first or time.perf_counter()
                            count += 1
                if response.status_code != 200 or not done or first is None:
                    errors += 1
                    continue
                ttft.append(first - start)
                e2e.append(time.perf_counter() - start)
                chunks.append(count)

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
    print(json.dumps({"elapsed": elapsed, "ttft": ttft, "e2e": e2e, "chunks": chunks, "errors": errors}))


# ---------------------------------------------------------------------------- driver


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _children_cpu_seconds() -> float:
    """CPU of finished child processes (the client runs are those that finish)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def _spawn(role: str, argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    from tests.servers import stop_process

    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--role", role, *argv], stdout=out, stderr=out)
    try:
        yield proc
    finally:
        stop_process(proc)


def _wait_for_workers(
    port: int, workers: int, frontend: subprocess.Popen[bytes], timeout: float = 60
) -> None:
    from tests.waiting import wait_until

    def seen() -> bool:
        with contextlib.suppress(httpx.TransportError, ValueError):
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            return health.status_code == 200 and health.json().get("workers") == workers
        return False

    wait_until(seen, f"the frontend to see {workers} workers", timeout, proc=frontend, interval=0.1)


def _run_client(argv: list[str], requests: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--role", "client", *argv, "--requests", str(requests)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _drive(args: argparse.Namespace) -> dict[str, Any]:
    from tests.servers import etcd_server, free_port, nats_server

    with tempfile.TemporaryDirectory(prefix="weir-bench-") as tmp:
        work = Path(tmp)
        if args.model_dir is None:
            from backends.deepinfer.tiny import build_tokenizer

            args.model_dir = str(build_tokenizer(work / "tokenizer"))
        port = free_port()
        (work / "etcd-data").mkdir()
        (work / "nats-data").mkdir()
        with etcd_server(work / "etcd-data") as etcd, nats_server(work / "nats-data") as nats:
            common = ["--etcd", etcd, "--nats", nats, "--port", str(port), "--model-dir", args.model_dir]
            worker_argv = [*common, "--workers", str(args.workers), "--speedup", str(args.speedup)]
            frontend_argv = [*common, "--router-mode", args.router_mode]
            client_argv = [
                *common,
                "--concurrency",
                str(args.concurrency),
                "--output-tokens",
                str(args.output_tokens),
            ]
            with (
                _spawn("workers", worker_argv, work / "workers.log") as workers,
                _spawn("frontend", frontend_argv, work / "frontend.log") as frontend,
            ):
                try:
                    _wait_for_workers(port, args.workers, frontend)
                    _run_client(client_argv, args.warmup)
                    before = _cpu_seconds(frontend.pid), _cpu_seconds(workers.pid), _children_cpu_seconds()
                    result = _run_client(client_argv, args.requests)
                    after = _cpu_seconds(frontend.pid), _cpu_seconds(workers.pid), _children_cpu_seconds()
                    cpu, workers_cpu, client_cpu = (a - b for a, b in zip(after, before, strict=True))
                except Exception:
                    for name in ("frontend.log", "workers.log"):
                        sys.stderr.write(f"--- {name}\n{(work / name).read_text()[-4000:]}\n")
                    raise
    done = len(result["e2e"])
    if done == 0:
        raise RuntimeError(f"no request succeeded ({result['errors']} errors)")
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "output_tokens": args.output_tokens,
        "workers": args.workers,
        "router_mode": args.router_mode,
        "errors": result["errors"],
        "requests_per_s": round(done / result["elapsed"], 1),
        "ttft_p50_ms": round(statistics.median(result["ttft"]) * 1e3, 2),
        "ttft_p99_ms": round(_percentile(result["ttft"], 0.99) * 1e3, 2),
        "e2e_p50_ms": round(statistics.median(result["e2e"]) * 1e3, 2),
        "e2e_p99_ms": round(_percentile(result["e2e"], 0.99) * 1e3, 2),
        "chunks_per_request": round(statistics.mean(result["chunks"]), 2),
        "frontend_cpu_ms_per_request": round(cpu * 1e3 / args.requests, 3),
        # For reading the latencies: on a small machine the client and workers share the cores.
        "workers_cpu_ms_per_request": round(workers_cpu * 1e3 / args.requests, 3),
        "client_cpu_ms_per_request": round(client_cpu * 1e3 / args.requests, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100, help="requests before measuring")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--speedup", type=float, default=1e6, help="mocker speedup: large is near-zero delay")
    parser.add_argument("--router-mode", default="kv")
    parser.add_argument("--model-dir", help="tokenizer directory (default: DeepInfer's tiny tokenizer)")
    parser.add_argument("--role", choices=("driver", "workers", "frontend", "client"), default="driver")
    parser.add_argument("--etcd")
    parser.add_argument("--nats")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()

    if args.role != "driver":
        import uvloop

        role = {"workers": _workers, "frontend": _frontend, "client": _client}[args.role]
        uvloop.run(role(args))
        return
    f = _drive(args)
    print(
        f"frontend overhead: {f['requests']} streamed chat requests x {f['output_tokens']} tokens, "
        f"concurrency {f['concurrency']}, {f['workers']} mocker workers ({f['router_mode']})\n"
        f"  throughput   {f['requests_per_s']} requests/s ({f['errors']} errors)\n"
        f"  TTFT         p50 {f['ttft_p50_ms']} ms   p99 {f['ttft_p99_ms']} ms\n"
        f"  end to end   p50 {f['e2e_p50_ms']} ms   p99 {f['e2e_p99_ms']} ms\n"
        f"  SSE chunks   {f['chunks_per_request']} per request (fewer than tokens: deltas that arrive\n"
        f"               together share one, and a token ending mid-character adds no text)\n"
        f"  frontend CPU {f['frontend_cpu_ms_per_request']} ms per request (target <= 2.5)\n"
        f"  workers CPU  {f['workers_cpu_ms_per_request']} ms, client CPU {f['client_cpu_ms_per_request']} "
        f"ms per request, all on {os.cpu_count()} cores"
    )
    print(json.dumps(f))


if __name__ == "__main__":
    main()
