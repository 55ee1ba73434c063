"""G4: KV blocks in Redis, shared by every worker of a model.

The remote tier is what lets one worker reuse a prefix another worker computed, so keys
carry only the layout and the sequence hash, nothing of the worker. Redis bounds the tier,
not the worker: entries expire `ttl_s` after they were last written, and under memory
pressure the server's maxmemory policy evicts (run it with `allkeys-lru`, for which a read
counts as use). Reads are plain GETs: renewing the TTL on every read (GETEX) cost a third of
the pipelined read throughput here (0.37 against 0.26 GB/s in `benchmarks/kvbm_tiers.py`). So
`put` never reports evictions: Redis makes them later, by itself.

`watch` is how the router still learns of them, and of blocks other workers stored before
this one started. A daemon thread of the store's own subscribes to the server's keyspace
notifications for expired and evicted keys (turning them on with CONFIG SET if they are off;
a managed Redis that refuses CONFIG gets one warning naming the setting its operator must
make), keeps the keys of this layout and reports their hashes as removed, a batch per
report. Once subscribed it SCANs the layout's keys (up to `SCAN_LIMIT`) and reports them as
stored, so a worker that joins credits the model with what G4 already holds; subscribing
first means a block that expires during the scan is reported removed after it was reported
stored. Every worker of the model reports the same blocks, and the router's index takes a
remote store or removal for every worker at once and is idempotent for both, so the
duplicates cost only their messages. Notifications sent while the thread is disconnected
are lost (Redis keeps none), and so are the blocks of a Redis that restarted empty, so after
each reconnect it reports the tier cleared (`cleared`: the router forgets G4 for every worker
of the model) and then scans again: what Redis dropped meanwhile stops being credited, and
what it still holds is credited again as the scan reports it. A snapshot does not list the
store, which would make it G4's size: `hashes()` is [] and has the watcher scan again, so the
remote part of a worker's snapshot follows it as events, which the router applies after it
(their event ids are later).

The store is a cache, so Redis being down must cost hit rate, never a step: the first
connection error or timeout switches the store off (one warning), every call is then a miss
or a no-op without touching the network, and after a back-off (1 s doubling to 30 s) the
next call sends a PING and switches the store back on if it is answered. redis-py's own
retries are turned off so that a call fails within `timeout_s`. A command Redis refuses
(out of memory under a noeviction policy) is a miss too, with a warning a minute at most,
but leaves the store on: the server is there, it is only full.

The transfer engine calls the store from several threads at once, so that several pipelines
are in flight. The client is shared: redis-py takes a connection from the client's pool for
each command or pipeline and gives it back after, so concurrent calls use their own
connections (the pool opens one per call in flight) and a pipeline is never shared. The
on/off state is under a lock: of the calls that fail together only the first switches the
store off and warns, and once the back-off has passed one call sends the PING while the
others stay misses.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvbm import records
from kvbm.records import Payload
from kvbm.stores import Cleared, Report
from orchestrator.runtime.protocol import Tier
from orchestrator.runtime.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
# A scan's bound: a worker joining adds at most this many hashes of events (about 10 MB).
SCAN_LIMIT = 1_000_000
SCAN_COUNT = 1000  # keys asked of each SCAN call, and hashes per stored report
REMOVED_BATCH = 1000  # notifications taken per removed report at most
WATCH_POLL_S = 0.5  # the watcher's longest wait for a notification, before it checks for close
NOTIFY_SETTING = "notify-keyspace-events"
NOTIFY_FLAGS = "Exe"  # keyevent channels; expired; evicted
# A pipeline's records are written into one buffer per thread, reused: a fresh record per block
# made every put fault in new pages, and writes ran at 0.54-0.58 of a raw pipelined SET instead
# of 0.83-0.88 (`benchmarks/kvbm_tiers.py`). Larger puts take several pipelines.
PIPELINE_BYTES = 16 << 20

_T = TypeVar("_T")


class RedisStore:
    """G4: Redis at `url`; `capacity_blocks` is nominal (Redis evicts, the worker never
    fills it)."""

    tier: Tier = "remote"
    capacity_blocks: int = sys.maxsize

    def __init__(
        self, url: str, layout: int, block_bytes: int, ttl_s: int = 3600, timeout_s: float = 0.5
    ) -> None:
        self.url = url
        self.layout = layout
        self.block_bytes = block_bytes
        self.ttl_s = ttl_s
        self._buffers = threading.local()  # each thread's record buffer (PIPELINE_BYTES)
        self.available = True
        self._prefix = f"weir:kv:{layout:016x}:"
        self._prefix_bytes = self._prefix.encode()  # as notifications and SCAN return keys
        self._state = threading.Lock()  # available, _backoff_s, _retry_at
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._refused = ThrottledWarning(log, every_s=60.0)
        self._watcher: threading.Thread | None = None
        self._closed = threading.Event()
        self._rescan = threading.Event()
        self._config_warned = False
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    def key(self, seq_hash: int) -> str:
        return f"{self._prefix}{seq_hash:016x}"

    def __len__(self) -> int:
        """0: the remote tier is not enumerated (see the module's docstring)."""
        return 0

    def __contains__(self, seq_hash: int) -> bool:
        return self._call(lambda c: bool(c.exists(self.key(seq_hash))), False)

    def get(self, seq_hash: int) -> Payload | None:
        return self.get_many([seq_hash])[0]

    def get_many(self, hashes: Iterable[int]) -> list[Payload | None]:
        """The blocks' payloads in one round trip, None for each miss; a damaged record is
        deleted, for every worker."""
        hashes = list(hashes)
        keys = [self.key(h) for h in hashes]

        def fetch(client: redis.Redis) -> list[Payload | None]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            values: list[Payload | None] = pipe.execute()
            payloads: list[Payload | None] = [
                None if value is None else records.decode(value, h, self.layout)
                for h, value in zip(hashes, values, strict=True)
            ]
            damaged = [
                key
                for key, value, payload in zip(keys, values, payloads, strict=True)
                if value is not None and payload is None
            ]
            if damaged:
                log.warning("%d KV block(s) in %s failed their check, deleted", len(damaged), self.url)
                client.delete(*damaged)
            return payloads

        return self._call(fetch, [None] * len(keys))

    def put(self, seq_hash: int, payload: Payload) -> list[int]:
        """Store (or refresh) a block; never evicts from the worker's side, so returns []."""
        self.put_many([(seq_hash, payload)])
        return []

    def put_many(self, items: Iterable[tuple[int, Payload]]) -> None:
        """Store blocks, a pipeline (one round trip) per PIPELINE_BYTES of records."""
        blocks = list(items)
        for _, payload in blocks:
            if len(payload) != self.block_bytes:
                raise ValueError(f"a block is {self.block_bytes} bytes here, got {len(payload)}")
        per_pipeline = max(1, PIPELINE_BYTES // (records.HEADER_BYTES + self.block_bytes))
        for start in range(0, len(blocks), per_pipeline):
            self._put_pipeline(blocks[start : start + per_pipeline])

    def _put_pipeline(self, blocks: list[tuple[int, Payload]]) -> None:
        buffer = self._record_buffer(len(blocks) * (records.HEADER_BYTES + self.block_bytes))
        encoded: list[tuple[str, memoryview]] = []
        offset = 0
        for seq_hash, payload in blocks:
            end = offset + records.encode_into(buffer[offset:], seq_hash, self.layout, payload)
            encoded.append((self.key(seq_hash), buffer[offset:end]))
            offset = end

        def store(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=False)
            for key, record in encoded:
                pipe.set(key, record, ex=self.ttl_s)
            pipe.execute()

        if encoded:
            self._call(store, None)  # the buffer is free again once this returns

    def _record_buffer(self, nbytes: int) -> memoryview:
        buffer: memoryview | None = getattr(self._buffers, "buffer", None)
        if buffer is None or len(buffer) < nbytes:
            buffer = memoryview(bytearray(nbytes))
            self._buffers.buffer = buffer
        return buffer

    def discard(self, seq_hash: int) -> None:
        """Delete the block, for every worker."""
        self._call(lambda c: c.delete(self.key(seq_hash)), None)

    def hashes(self) -> list[int]:
        """[], and the watcher scans again: its blocks follow as stored reports (see the
        module's docstring)."""
        self._rescan.set()
        return []

    def watch(self, stored: Report, removed: Report, cleared: Cleared) -> None:
        """Report, from a daemon thread that `close` stops, the layout's blocks found in
        Redis (`stored`) and those it expires or evicts (`removed`), in batches; and, before
        the scan that follows each reconnect, that what was reported before may be gone
        (`cleared`)."""
        if self._watcher is not None:
            raise RuntimeError("the store is already watched")
        self._watcher = threading.Thread(
            target=self._watch, args=(stored, removed, cleared), name="weir-kv-redis-watch", daemon=True
        )
        self._watcher.start()

    def close(self) -> None:
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        self._client.close()

    def _watch(self, stored: Report, removed: Report, cleared: Cleared) -> None:
        """Subscribe and scan, then report notifications until closed; on a lost connection,
        the same again after a back-off (1 s doubling to 30 s), logged once per outage."""
        db = self._client.connection_pool.connection_kwargs.get("db", 0)
        channels = [f"__keyevent@{db}__:expired", f"__keyevent@{db}__:evicted"]
        backoff_s = BACKOFF_START_S
        connected = True
        watched = False  # subscribed before: notifications since then may have been missed
        while not self._closed.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                self._enable_notifications()
                pubsub.subscribe(*channels)
                if not connected:
                    log.info("KV store %s answers again: watching its expiries and evictions", self.url)
                connected, backoff_s = True, BACKOFF_START_S
                if watched:
                    cleared()  # removals missed while away are lost: forget all, then scan
                watched = True
                self._rescan.set()
                while not self._closed.is_set():
                    if self._rescan.is_set():
                        self._rescan.clear()
                        self._scan(stored)
                    self._drain(pubsub, removed)
            except (RedisConnectionError, RedisTimeoutError) as e:
                if connected:
                    log.info("KV store %s unreachable (%s): not watching it until it answers", self.url, e)
                connected = False
            except RedisError as e:  # refused, e.g. an ACL without these channels
                self._refused("KV store %s refused its watcher: %s", self.url, e)
            finally:
                pubsub.close()
            self._closed.wait(backoff_s)
            backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)

    def _enable_notifications(self) -> None:
        """Add the flags the watcher needs to the server's; a server that refuses CONFIG
        (managed services do) is warned of once, and watched all the same: its operator may
        have set them."""
        try:
            flags = str(self._client.config_get(NOTIFY_SETTING).get(NOTIFY_SETTING, ""))
            have = set(flags) | (set("xe") if "A" in flags else set())  # A: every class but m, n
            missing = "".join(flag for flag in NOTIFY_FLAGS if flag not in have)
            if missing:
                self._client.config_set(NOTIFY_SETTING, flags + missing)
        except ResponseError as e:
            if not self._config_warned:
                self._config_warned = True
                log.warning(
                    "KV store %s refuses CONFIG (%s): set %s to include %s there, or the router "
                    "keeps crediting G4 blocks Redis has expired or evicted",
                    self.url,
                    e,
                    NOTIFY_SETTING,
                    NOTIFY_FLAGS,
                )

    def _scan(self, stored: Report) -> None:
        found: list[int] = []
        keys = self._client.scan_iter(match=f"{self._prefix}*", count=SCAN_COUNT)
        for n, key in enumerate(keys):
            if self._closed.is_set():
                return
            if n == SCAN_LIMIT:
                log.info("KV store %s holds over %d blocks of this layout: reported those", self.url, n)
                break
            seq_hash = self._seq_hash(key)
            if seq_hash is not None:
                found.append(seq_hash)
            if len(found) == SCAN_COUNT:
                stored(found)
                found = []
        if found:
            stored(found)

    def _drain(self, pubsub: PubSub, removed: Report) -> None:
        """Wait for a notification, then take those already arrived: one report for them."""
        gone: list[int] = []
        timeout = WATCH_POLL_S
        for _ in range(REMOVED_BATCH):
            message = pubsub.get_message(timeout=timeout)
            if message is None:
                break
            timeout = 0.0
            seq_hash = self._seq_hash(message["data"])
            if seq_hash is not None:
                gone.append(seq_hash)
        if gone:
            removed(gone)

    def _seq_hash(self, key: bytes) -> int | None:
        """The hash in a key of this layout; None for any other key."""
        prefix = self._prefix_bytes
        if not key.startswith(prefix):
            return None
        try:
            return int(key[len(prefix) :], 16)
        except ValueError:
            return None

    def _call(self, op: Callable[[redis.Redis], _T], miss: _T) -> _T:
        """`op(client)`, or `miss` while Redis is unreachable (and when it turns out to be)."""
        # `available` is read without the lock: a stale value costs one miss or one failed call.
        if not self.available and not self._recovered():
            return miss
        try:
            return op(self._client)
        except ResponseError as e:  # an error of this command, e.g. OOM under noeviction
            self._refused("KV store %s refused a command: %s", self.url, e)
            return miss
        except (RedisConnectionError, RedisTimeoutError) as e:
            with self._state:
                if not self.available:  # a concurrent call found it first, and warned
                    return miss
                self.available = False
                self._backoff_s = BACKOFF_START_S
                self._retry_at = time.monotonic() + self._backoff_s
            log.warning("KV store %s unreachable (%s): remote tier off until it answers again", self.url, e)
            return miss

    def _recovered(self) -> bool:
        """Once the back-off has passed, PING (one call does; the others meanwhile are
        misses); on an answer the store is back on, otherwise the back-off doubles."""
        with self._state:
            if self.available:
                return True
            if time.monotonic() < self._retry_at:
                return False
            self._retry_at = math.inf  # this call probes
        try:
            self._client.ping()
        except RedisError:  # any failure, or the probe would never be sent again
            with self._state:
                self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
                self._retry_at = time.monotonic() + self._backoff_s
            return False
        with self._state:
            self.available = True
        log.info("KV store %s answers again: remote tier back on", self.url)
        return True
