"""KV data plane throughput against its ceilings, in one run.

A sender process serves held transfers on the request plane's `kv_blocks` endpoint
(`KvTransferServer` over an engine stub that holds `--blocks` records of each size) and, beside
it, a bare socket that sends the same bytes. The receiver (this process) measures, per record
size:

- same host: `pull_kv` through shared memory against a plain in-process copy of the same
  records, each into a buffer of its own, all alive at the end (as a pull's are);
- TCP over loopback: `pull_kv` with shared memory off against the bare socket's throughput
  (`sendall` of the records, `recv_into` one preallocated buffer: no framing, no copies);
- with `--fabric mooncake` (needs `weir[mooncake]`), instead of the two above: Mooncake's
  transfer engine over loopback TCP, `pull_kv` with shared memory off and a fabric on both
  sides (`weir worker --kv-transport mooncake`), against the same bare socket and our own TCP
  stream, side by side. A run of its own, since the fabric's buffers change what the
  allocator gives the plain copy.

Each figure is the median of `--repeats` timed runs after one warm-up.

    python benchmarks/kv_transfer.py                  # 64 blocks of 2 MiB and of 256 KiB
    python benchmarks/kv_transfer.py --fabric mooncake

Prints a table and ends with one JSON line: per size GB/s of each path and the ratios, plus
the smallest ratio of each kind over the sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from orchestrator.runtime.kv_fabric import FABRICS, KvFabric, make_fabric
from orchestrator.runtime.kv_transfer import host_id
from orchestrator.runtime.kv_transfer_client import pull_kv
from orchestrator.runtime.kv_transfer_server import KvTransferServer
from orchestrator.runtime.protocol import KvTransfer
from orchestrator.runtime.request_plane import KV_BLOCKS, RequestPlaneClient, RequestPlaneServer

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    uvloop = None  # type: ignore[assignment]

REPO = Path(__file__).resolve().parents[1]


def make_records(blocks: int, size: int) -> list[bytes]:
    return [bytes([i % 251]) * size for i in range(blocks)]


class HeldRecords:
    """An engine's transfer side that holds the same records under every id `<size>-<n>`."""

    def __init__(self, by_size: dict[int, list[bytes]]) -> None:
        self.by_size = by_size

    def read_transfer(self, transfer_id: str) -> list[bytes] | None:
        return self.by_size.get(int(transfer_id.split("-")[0]))

    def release_transfer(self, transfer_id: str) -> None:
        pass


def serve_raw(sock: socket.socket, by_size: dict[int, list[bytes]]) -> None:
    """The bare socket: for each 8-byte record size asked, send that size's records."""
    while True:
        conn, _ = sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while asked := conn.recv(8, socket.MSG_WAITALL):
                for record in by_size[int.from_bytes(asked, "big")]:
                    conn.sendall(record)


async def sender(blocks: int, sizes: list[int], offers: int, fabric: KvFabric | None) -> None:
    by_size = {size: make_records(blocks, size) for size in sizes}
    kv = KvTransferServer(HeldRecords(by_size), "bench-sender", hold_s=3600, fabric=fabric)
    for size in sizes:
        for n in range(offers):
            kv.offer(KvTransfer(transfer_id=f"{size}-{n}"))
    server = RequestPlaneServer({KV_BLOCKS: kv.serve})
    port = await server.start("127.0.0.1", 0)
    raw = socket.create_server(("127.0.0.1", 0))
    print(port, raw.getsockname()[1], flush=True)
    await asyncio.to_thread(serve_raw, raw, by_size)


def raw_receive(port: int, size: int, blocks: int) -> float:
    total = size * blocks
    into = memoryview(bytearray(total))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        sock.sendall(size.to_bytes(8, "big"))
        got = 0
        while got < total:
            got += sock.recv_into(into[got:])
        return time.perf_counter() - start


async def timed(run: Callable[[], Awaitable[object]], repeats: int) -> float:
    await run()  # warm-up: connections, page cache, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def receiver(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    sizes = [kib * 1024 for kib in args.size_kib]
    fabric = make_fabric(args.fabric, "127.0.0.1") if args.fabric else None
    # Each pull serves one offer: per size and transport, a check, a warm-up and the repeats.
    offers = 2 * (args.repeats + 2)
    command = [sys.executable, __file__, "--serve", f"--blocks={args.blocks}", f"--offers={offers}"]
    command += [f"--fabric={args.fabric}"] if args.fabric else []
    proc = subprocess.Popen(command + [f"--size-kib={kib}" for kib in args.size_kib], stdout=subprocess.PIPE)
    client = RequestPlaneClient()
    try:
        assert proc.stdout is not None
        plane_port, raw_port = map(int, proc.stdout.readline().split())
        results: dict[str, dict[str, float]] = {}
        for size in sizes:
            total = size * args.blocks
            records = make_records(args.blocks, size)
            ids = itertools.count()

            def pull(
                local: bool, fabric: KvFabric | None = None, size: int = size, ids: Iterator[int] = ids
            ) -> Awaitable[list[bytes | memoryview]]:
                transfer = KvTransfer(
                    transfer_id=f"{size}-{next(ids)}",
                    address=f"127.0.0.1:{plane_port}",
                    host_id=host_id() if local else "",
                    block_hashes=list(range(args.blocks)),
                    block_bytes=size,
                )
                return pull_kv(client, transfer, 60, fabric=fabric)

            assert await pull(False) == records, "records differ"
            assert await (pull(True) if fabric is None else pull(False, fabric)) == records, "records differ"

            async def copy(records: list[bytes] = records) -> list[bytes]:
                # Each record copied once into a buffer of its own, all kept: what a pull yields.
                return [bytes(memoryview(record)) for record in records]

            def raw(size: int = size) -> Awaitable[float]:
                return asyncio.to_thread(raw_receive, raw_port, size, args.blocks)

            seconds: dict[str, float] = {}
            if fabric is None:
                seconds["memcpy"] = await timed(copy, args.repeats)
                seconds["shm"] = await timed(lambda: pull(True), args.repeats)
                pairs = [("shm", "memcpy"), ("tcp", "raw_socket")]
            else:
                pairs = [("tcp", "raw_socket"), (fabric.name, "raw_socket"), (fabric.name, "tcp")]
            seconds["raw_socket"] = await timed(raw, args.repeats)
            seconds["tcp"] = await timed(lambda: pull(False), args.repeats)
            if fabric is not None:
                seconds[fabric.name] = await timed(lambda: pull(False, fabric), args.repeats)
            figures = {f"{name}_gbps": round(total / t / 1e9, 2) for name, t in seconds.items()}
            for path, limit in pairs:
                figures[f"{path}_vs_{limit}"] = round(seconds[limit] / seconds[path], 3)
            results[f"{args.blocks}x{size // 1024}KiB"] = figures
            print(
                f"{args.blocks} x {size // 1024:>5} KiB: " + ", ".join(f"{k} {v}" for k, v in figures.items())
            )
        return results
    finally:
        await client.close()
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--size-kib", type=int, action="append", help="record size (repeatable)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fabric", choices=FABRICS, help="measure this fabric beside TCP (see above)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the sender process
    parser.add_argument("--offers", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.size_kib = args.size_kib or [2048, 256]
    run = uvloop.run if uvloop is not None else asyncio.run
    if args.serve:
        fabric = make_fabric(args.fabric, "127.0.0.1") if args.fabric else None
        run(sender(args.blocks, [kib * 1024 for kib in args.size_kib], args.offers, fabric))
        return
    results = run(receiver(args))
    first = next(iter(results.values()))
    summary: dict[str, object] = {
        ratio: min(r[ratio] for r in results.values()) for ratio in first if "_vs_" in ratio
    }
    summary["sizes"] = results
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
