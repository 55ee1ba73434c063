"""Request-plane cost per streamed delta over loopback TCP.

Two processes on 127.0.0.1: a `RequestPlaneServer` whose `generate`-like handler streams
`--tokens` pre-encoded TokenDeltas per call (no engine, so only the plane is measured), and
a caller that keeps `--concurrency` streams open at a time on one pooled connection, decoding
every delta with `TcpWorkerClient` as the frontend does. CPU time of each process (user +
system) is divided by the number of deltas and requests.

    python benchmarks/request_plane.py                  # 2,000 requests x 16 deltas, concurrency 16

Prints a summary and ends with one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import msgspec

from orchestrator.runtime.protocol import TokenDelta, Usage, WorkerRequest
from orchestrator.runtime.request_plane import RequestPlaneClient, RequestPlaneServer, TcpWorkerClient

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    uvloop = None  # type: ignore[assignment]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def serve(port: int) -> None:
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(WorkerRequest).decode

    async def generate(payload: bytes) -> AsyncIterator[bytes]:
        request = decode(payload)
        n = request.max_tokens
        for i in range(n - 1):
            yield encode(TokenDelta(token_ids=[1000 + i]))
            await asyncio.sleep(0)  # a real engine yields the loop between steps
        yield encode(
            TokenDelta(
                token_ids=[1000 + n],
                finish_reason="length",
                usage=Usage(prompt_tokens=8, completion_tokens=n),
            )
        )

    server = RequestPlaneServer({"generate": generate})
    await server.start("127.0.0.1", port)
    print("ready", flush=True)
    await asyncio.Event().wait()


async def drive(port: int, requests: int, concurrency: int, tokens: int) -> tuple[float, int]:
    client = RequestPlaneClient()
    worker = TcpWorkerClient(client, f"127.0.0.1:{port}")
    prompt = list(range(8))
    deltas = 0
    queue = iter(range(requests))

    async def one_stream() -> None:
        nonlocal deltas
        for i in queue:
            request = WorkerRequest(request_id=str(i), token_ids=prompt, max_tokens=tokens)
            async for _ in worker.generate(request):
                deltas += 1

    started = time.perf_counter()
    await asyncio.gather(*(one_stream() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await client.close()
    return elapsed, deltas


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    run = uvloop.run if uvloop is not None else asyncio.run
    if args.serve is not None:
        run(serve(args.serve))
        return

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, __file__, "--serve", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        run(drive(port, 200, args.concurrency, args.tokens))  # warm-up
        server_cpu, client_cpu = cpu_seconds(server.pid), time.process_time()
        elapsed, deltas = run(drive(port, args.requests, args.concurrency, args.tokens))
        server_cpu, client_cpu = cpu_seconds(server.pid) - server_cpu, time.process_time() - client_cpu
    finally:
        server.kill()
        server.wait()

    figures = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "deltas": deltas,
        "deltas_per_s": round(deltas / elapsed),
        # Every call is one Call frame out, its deltas as Data frames, and one End frame back.
        "frames_per_s": round((deltas + 2 * args.requests) / elapsed),
        "requests_per_s": round(args.requests / elapsed, 1),
        "caller_cpu_us_per_delta": round(client_cpu / deltas * 1e6, 2),
        "caller_cpu_us_per_request": round(client_cpu / args.requests * 1e6, 1),
        "server_cpu_us_per_delta": round(server_cpu / deltas * 1e6, 2),
    }
    print(
        f"{deltas} deltas in {elapsed:.2f} s: {figures['deltas_per_s']} deltas/s, "
        f"{figures['requests_per_s']} requests/s "
        f"(concurrency {args.concurrency}, {args.tokens} tokens each)\n"
        f"caller CPU: {figures['caller_cpu_us_per_delta']} us/delta, "
        f"{figures['caller_cpu_us_per_request']} us/request (incl. WorkerRequest encode)\n"
        f"server CPU: {figures['server_cpu_us_per_delta']} us/delta (incl. TokenDelta encode, handler)"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
