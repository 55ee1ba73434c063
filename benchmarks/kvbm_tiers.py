"""What each KV tier's store costs, against the raw limit of the medium under it.

A store is worth what it adds on top of the medium: a copy into the record (header and
checksum), the checksum itself, the index, and for Redis the client. So each tier is timed
twice on the same block size in one run, once raw (the cheapest way to move those bytes:
slice assignment into a bytearray, and a copy out of it into a buffer; `os.pwrite` and
`os.preadv` of whole slots on an O_DIRECT file, or a buffered one where the filesystem
refuses O_DIRECT; pipelined SET/GET of values of the record's size) and once through the
store, and the ratio store/raw is the figure to watch: a falling ratio is the store's
overhead growing, whatever the machine.

Raw and store passes alternate, and each figure is the best of `--repeat` passes over
`--mib` MiB: a shared machine's disk and cores drift by tens of percent within a minute, and
timing the two back to back keeps that drift out of the ratio. Every figure counts block
payload bytes (the raw passes move the same slots and values as the stores, headers and
padding included), so a ratio is a ratio of blocks per second.

Onboarding reads a sequence's prefix from disk with one `get_prefix` call, which reads each
run of adjacent slots at once, and a step's evictions from host memory go to disk in one
`put_blocks` call, which writes them the same way, so the disk is also timed that way:
batches of `--batch` blocks through the store against raw reads and writes of the same runs
of slots (disk_get_prefix against disk_raw_read_run, disk_put_blocks against
disk_raw_write_run). It runs on the transfer engine's pool of threads, so the disk
and Redis reads are timed once more that way: the same blocks read back as transfer jobs of
`--batch` blocks each (one disk `get_prefix`, one Redis `get_many` per job) on `--workers`
threads, from the first submit until the pool is idle, the disk's against raw reads of the
same runs on a pool of its own (disk_raw_read_pool). pool_speedup_<tier>_get is the pooled
figure against the store's single-thread one (the disk's: its `get_prefix`).

Buffered disk I/O reads back from the page cache, so `disk_direct: false` figures are
memory speeds, not the disk's. Redis runs on this machine (its own redis-server on a free
port unless `--redis-url` is given), so its figures are the client's and the loopback's
limits, not a network's.

    python benchmarks/kvbm_tiers.py [--block-bytes 65536] [--mib 256] [--batch 32] [--workers 4]
        [--redis-url URL]

Final JSON line: block_bytes, blocks, pool_workers, disk_direct, and in GB/s: memcpy,
memcpy_out, disk_raw_write, disk_raw_write_run, disk_raw_read, disk_raw_read_run,
disk_raw_read_pool, redis_raw_set, redis_raw_get, host_put, host_get, disk_put,
disk_put_blocks, disk_get, disk_get_prefix, disk_get_pool, redis_put_many, redis_get_many,
redis_get_many_pool; then ratio_<tier>_<op> = store / raw (host_get against memcpy_out,
host_put against memcpy, disk_put_blocks against disk_raw_write_run, disk_get_prefix against
disk_raw_read_run, disk_get_pool against disk_raw_read_pool) and pool_speedup_disk_get,
pool_speedup_redis_get.
"""

from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import redis

from kvbm import records
from kvbm.disk import DiskStore, slot_bytes
from kvbm.redis_store import RedisStore
from kvbm.stores import HostStore
from kvbm.transfer import TransferEngine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.servers, which starts the redis-server

LAYOUT = records.layout_id("kvbm_tiers benchmark")
SMOLLM2_BLOCK = 30 * 2 * 3 * 64 * 16 * 4  # layers x (K, V) x kv heads x head dim x tokens x fp32
DISTINCT = 16  # payloads cycled through: the bytes themselves do not matter, only that they vary

Pass = Callable[[int], object]  # one pass over all blocks; its argument is the pass's index


def paired(nbytes: int, repeat: int, raw: Pass, store: Pass) -> tuple[float, float]:
    """The best of `repeat` alternating passes of `raw` and `store` moving `nbytes`, GB/s."""
    best = [float("inf"), float("inf")]
    for r in range(repeat):
        for i, run in enumerate((raw, store)):
            started = time.perf_counter()
            run(r)
            best[i] = min(best[i], time.perf_counter() - started)
    return nbytes / best[0] / 1e9, nbytes / best[1] / 1e9


def each(n: int, op: Callable[[int], object]) -> None:
    """`op(i)` for i in range(n), results dropped at once: keeping them would time the
    allocator's page faults, not the copies."""
    for i in range(n):
        op(i)


def batches(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(start + size, n))


def pooled(
    nbytes: int, n: int, batch: int, workers: int, repeat: int, read: Callable[[range], object]
) -> float:
    """The best of `repeat` passes reading blocks 0..n-1 as transfer jobs of `batch` blocks
    (`read(hashes)`) on a pool of `workers` threads, GB/s."""

    def job(hashes: range) -> None:
        read(hashes)

    best = float("inf")
    for _ in range(repeat):
        transfer = TransferEngine(max_pending=n, workers=workers)
        started = time.perf_counter()
        for hashes in batches(n, batch):
            assert transfer.submit(partial(job, hashes))
        assert transfer.wait_idle()
        best = min(best, time.perf_counter() - started)
        transfer.close()
    return nbytes / best / 1e9


def host_tier(payloads: list[bytes], n: int, repeat: int) -> dict[str, float]:
    """Raw is slice assignment into one big bytearray for puts, and for gets a copy out of it
    into the buffer the block goes to (the host tier hands out a view of its slot, and the
    engine's one copy is into its cache: `out` stands for that)."""
    size = len(payloads[0])
    view = memoryview(bytearray(n * size))
    out = memoryview(bytearray(size))
    store = HostStore(n, size)

    def copy_in(i: int) -> None:
        view[i * size : (i + 1) * size] = payloads[i % DISTINCT]

    def copy_out(i: int) -> None:
        out[:] = view[i * size : (i + 1) * size]

    def get_out(i: int) -> None:
        block = store.get(last + i)
        assert block is not None
        out[:] = block

    # Pass r stores new hashes, so from the second pass on every put evicts, as in a full cache.
    memcpy, put = paired(
        n * size,
        repeat,
        lambda _: each(n, copy_in),
        lambda r: each(n, lambda i: store.put(r * n + i, payloads[i % DISTINCT])),
    )
    last = (repeat - 1) * n
    memcpy_out, get = paired(n * size, repeat, lambda _: each(n, copy_out), lambda _: each(n, get_out))
    store.close()
    return {"memcpy_GBps": memcpy, "memcpy_out_GBps": memcpy_out, "host_put_GBps": put, "host_get_GBps": get}


def open_direct(path: Path) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644), False


def disk_tier(
    directory: Path, payloads: list[bytes], n: int, batch: int, workers: int, repeat: int
) -> dict[str, float | bool]:
    """Whole-slot writes and reads, as DiskStore does them, without records or an index; and
    prefixes of `batch` blocks read as onboarding reads them (`get_prefix`), against raw
    reads of the same runs of slots."""
    size = len(payloads[0])
    slot = slot_bytes(size)
    buffer = mmap.mmap(-1, batch * slot)  # a prefix's adjacent slots are one read
    buffer[:size] = payloads[0]
    view = memoryview(buffer)
    one_slot = view[:slot]
    fd, direct = open_direct(directory / "raw.slab")
    os.posix_fallocate(fd, 0, n * slot)
    store = DiskStore(directory, n, size, LAYOUT)
    last = (repeat - 1) * n

    def raw_runs(_: int) -> None:
        for hashes in batches(n, batch):
            os.preadv(fd, [view[: len(hashes) * slot]], hashes.start * slot)

    def raw_write_runs(_: int) -> None:
        for hashes in batches(n, batch):
            os.pwrite(fd, view[: len(hashes) * slot], hashes.start * slot)

    def put_runs(r: int) -> None:  # fresh hashes, after the single puts' (r * n + i)
        base = (repeat + r) * n
        for hashes in batches(n, batch):
            store.put_blocks([(base + i, payloads[i % DISTINCT]) for i in hashes])

    local = threading.local()  # each transfer thread's own buffer for the raw pooled reads
    thread_buffers: list[mmap.mmap] = []

    def raw_job(hashes: range) -> None:
        if not hasattr(local, "view"):
            thread_buffers.append(mmap.mmap(-1, batch * slot))
            local.view = memoryview(thread_buffers[-1])
        os.preadv(fd, [local.view[: len(hashes) * slot]], hashes.start * slot)

    def shifted(hashes: range) -> range:
        return range(last + hashes.start, last + hashes.stop)

    def prefixes(_: int) -> None:
        for hashes in batches(n, batch):
            store.get_prefix(shifted(hashes))

    try:
        raw_write_run, put_blocks = paired(n * size, repeat, raw_write_runs, put_runs)
        raw_write, put = paired(
            n * size,
            repeat,
            lambda _: each(n, lambda i: os.pwrite(fd, one_slot, i * slot)),
            lambda r: each(n, lambda i: store.put(r * n + i, payloads[i % DISTINCT])),
        )
        raw_read, get = paired(
            n * size,
            repeat,
            lambda _: each(n, lambda i: os.preadv(fd, [one_slot], i * slot)),
            lambda _: each(n, lambda i: store.get(last + i)),
        )
        raw_read_run, get_prefix = paired(n * size, repeat, raw_runs, prefixes)
        assert all(store.get(last + i) == payloads[i % DISTINCT] for i in range(0, n, max(1, n // 16)))
        assert store.get_prefix(range(last, last + batch)) == [payloads[i % DISTINCT] for i in range(batch)]
        raw_pool, pool = 0.0, 0.0
        for _ in range(repeat):  # alternating, as `paired`
            raw_pool = max(raw_pool, pooled(n * size, n, batch, workers, 1, raw_job))
            pool = max(
                pool, pooled(n * size, n, batch, workers, 1, lambda hashes: store.get_prefix(shifted(hashes)))
            )
    finally:
        os.close(fd)
        one_slot.release()
        view.release()
        buffer.close()
        for thread_buffer in thread_buffers:  # the pool's threads have ended: their views are gone
            thread_buffer.close()
        store.close()
    return {
        "disk_direct": direct and store.direct,
        "disk_raw_write_GBps": raw_write,
        "disk_raw_write_run_GBps": raw_write_run,
        "disk_raw_read_GBps": raw_read,
        "disk_raw_read_run_GBps": raw_read_run,
        "disk_put_GBps": put,
        "disk_put_blocks_GBps": put_blocks,
        "disk_get_GBps": get,
        "disk_get_prefix_GBps": get_prefix,
        "disk_raw_read_pool_GBps": raw_pool,
        "disk_get_pool_GBps": pool,
    }


def redis_tier(
    url: str, payloads: list[bytes], n: int, batch: int, workers: int, repeat: int
) -> dict[str, float]:
    client = redis.Redis.from_url(url)
    store = RedisStore(url, LAYOUT, len(payloads[0]))
    value = b"\0" * records.HEADER_BYTES + payloads[0]

    def raw_set(_: int) -> None:
        for keys in batches(n, batch):
            pipe = client.pipeline(transaction=False)
            for i in keys:
                pipe.set(f"bench:raw:{i}", value, ex=3600)
            pipe.execute()

    def raw_get(_: int) -> None:
        for keys in batches(n, batch):
            pipe = client.pipeline(transaction=False)
            for i in keys:
                pipe.get(f"bench:raw:{i}")
            pipe.execute()

    def put_many(_: int) -> None:
        for hashes in batches(n, batch):
            store.put_many((h, payloads[h % DISTINCT]) for h in hashes)

    def get_many(_: int) -> None:
        for hashes in batches(n, batch):
            store.get_many(hashes)

    nbytes = n * len(payloads[0])
    raw_set_gbps, put = paired(nbytes, repeat, raw_set, put_many)
    raw_get_gbps, get = paired(nbytes, repeat, raw_get, get_many)
    pool = pooled(nbytes, n, batch, workers, repeat, store.get_many)
    assert store.available and store.get_many([n - 1]) == [payloads[(n - 1) % DISTINCT]]
    client.flushall()
    client.close()
    store.close()
    return {
        "redis_raw_set_GBps": raw_set_gbps,
        "redis_raw_get_GBps": raw_get_gbps,
        "redis_put_many_GBps": put,
        "redis_get_many_GBps": get,
        "redis_get_many_pool_GBps": pool,
    }


@contextmanager
def redis_url(given: str | None, workdir: Path) -> Iterator[str]:
    if given is not None:
        yield given
        return
    from tests.servers import redis_server

    with redis_server(workdir) as url:
        yield url


RATIOS = {  # name: (store, raw)
    "host_put": ("host_put_GBps", "memcpy_GBps"),
    "host_get": ("host_get_GBps", "memcpy_out_GBps"),
    "disk_put": ("disk_put_GBps", "disk_raw_write_GBps"),
    "disk_put_blocks": ("disk_put_blocks_GBps", "disk_raw_write_run_GBps"),
    "disk_get": ("disk_get_GBps", "disk_raw_read_GBps"),
    "disk_get_prefix": ("disk_get_prefix_GBps", "disk_raw_read_run_GBps"),
    "disk_get_pool": ("disk_get_pool_GBps", "disk_raw_read_pool_GBps"),
    "redis_put": ("redis_put_many_GBps", "redis_raw_set_GBps"),
    "redis_get": ("redis_get_many_GBps", "redis_raw_get_GBps"),
}


POOLED = {  # tier: (pooled read, single-thread read)
    "disk": ("disk_get_pool_GBps", "disk_get_prefix_GBps"),
    "redis": ("redis_get_many_pool_GBps", "redis_get_many_GBps"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--block-bytes", type=int, default=64 * 1024, help=f"SmolLM2-135M's is {SMOLLM2_BLOCK}"
    )
    parser.add_argument("--mib", type=int, default=256, help="bytes moved per pass of each measurement")
    parser.add_argument("--batch", type=int, default=32, help="blocks per Redis pipeline and per pooled read")
    parser.add_argument("--workers", type=int, default=4, help="transfer threads for the pooled reads")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--redis-url", help="an existing Redis (it is FLUSHALLed); default: start one")
    parser.add_argument(
        "--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the slab files go"
    )
    args = parser.parse_args()

    size: int = args.block_bytes
    n = max(1, args.mib * 2**20 // size)
    payloads = [os.urandom(size) for _ in range(DISTINCT)]
    figures: dict[str, float | int | bool] = {"block_bytes": size, "blocks": n, "pool_workers": args.workers}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, redis_url(args.redis_url, Path(tmp)) as url:
        figures |= host_tier(payloads, n, args.repeat)
        figures |= disk_tier(Path(tmp), payloads, n, args.batch, args.workers, args.repeat)
        figures |= redis_tier(url, payloads, n, args.batch, args.workers, args.repeat)
    for name, (store, raw) in RATIOS.items():
        figures[f"ratio_{name}"] = figures[store] / figures[raw]
    for tier, (pool, single) in POOLED.items():
        figures[f"pool_speedup_{tier}_get"] = figures[pool] / figures[single]
    rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}

    io = "O_DIRECT" if figures["disk_direct"] else "buffered"
    print(f"block {size} bytes, {n} blocks per pass, disk {io}")
    print(f"{'':<10}{'raw':>20}{'GB/s':>8}{'store':>20}{'GB/s':>8}{'store/raw':>11}")
    for name, (store, raw) in RATIOS.items():
        print(
            f"{name:<10}{raw.removesuffix('_GBps'):>20}{rounded[raw]:>8}"
            f"{store.removesuffix('_GBps'):>20}{rounded[store]:>8}{rounded[f'ratio_{name}']:>11}"
        )
    for tier, (pool, single) in POOLED.items():
        print(
            f"{tier} get on {args.workers} transfer threads: {rounded[pool]} GB/s,"
            f" {rounded[f'pool_speedup_{tier}_get']}x one thread's {rounded[single]}"
        )
    print(json.dumps(rounded))


if __name__ == "__main__":
    main()
