"""Discovery on etcd v3 (through `aetcd`).

Keys live under `weir/<namespace>/` (see `keys.py`); instance values are msgpack `Instance`s.

Leases: one lease per `EtcdDiscovery`, granted on the first leased put, refreshed every
TTL/3 in the background. Every leased key is remembered locally, so when the lease is lost
(etcd unreachable for longer than the TTL, or restarted without its data) a new lease is
granted and the keys are written again.

Watches: a prefix watch lists the prefix, then watches from the listed revision + 1, so no
change falls between the two. When the watch breaks (etcd down, compaction), it retries with
backoff and on success lists again and reports only the differences: the last known keys stay
while etcd is away, which is what keeps workers routable during an etcd outage.

TLS: an https:// URL dials etcd over TLS, verifying it against the bundle `SSL_CERT_FILE`
names (else gRPC's roots), and presents the client certificate `WEIR_ETCD_CERT_FILE` and
`WEIR_ETCD_KEY_FILE` name when both are set (etcd's --client-cert-auth).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

import aetcd
import grpc
from aetcd import rpc, watcher

from orchestrator.runtime.discovery.base import DEFAULT_TTL, Discovery, DiscoveryUnavailable, KeyEvent
from orchestrator.runtime.discovery.keys import namespace_root
from orchestrator.runtime.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)

# gRPC pings detect a silently dead etcd (etcd refuses pings more often than every 5 s), and a
# short reconnect backoff finds a restarted etcd within ~2 s instead of gRPC's default 120 s.
_GRPC_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 250,
    "grpc.max_reconnect_backoff_ms": 2_000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
}
_RETRY_MAX_S = 2.0


class EtcdUnavailable(DiscoveryUnavailable, aetcd.ClientError):
    """DiscoveryUnavailable for callers of the abstraction; still an aetcd.ClientError for
    code written against aetcd."""


@contextlib.contextmanager
def _unavailable_on_error() -> Iterator[None]:
    try:
        yield
    except aetcd.ClientError as exc:
        raise EtcdUnavailable(f"etcd: {exc}") from exc


def _read(env: str) -> bytes | None:
    path = os.environ.get(env)
    return Path(path).read_bytes() if path else None


class _TlsClient(aetcd.Client):
    """aetcd's client on a TLS channel. aetcd (1.0) dials only `insecure_channel`, in
    `connect`; this `connect` differs from it in that one call, and builds the same stubs."""

    _is_connecting: bool

    def __init__(self, credentials: grpc.ChannelCredentials, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = rpc.secure_channel(target, self._credentials, options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                request = rpc.AuthenticateRequest(name=self._username, password=self._password)
                reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                self.metadata = (("token", reply.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False


def _tls_credentials() -> grpc.ChannelCredentials:
    cert, key = _read("WEIR_ETCD_CERT_FILE"), _read("WEIR_ETCD_KEY_FILE")
    if (cert is None) != (key is None):
        raise ValueError("WEIR_ETCD_CERT_FILE and WEIR_ETCD_KEY_FILE go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read("SSL_CERT_FILE"), private_key=key, certificate_chain=cert
    )


class EtcdDiscovery(Discovery):
    def __init__(self, url: str, namespace: str, ttl: float = DEFAULT_TTL, timeout: float = 5.0) -> None:
        super().__init__(namespace, ttl)
        parsed = urlparse(url if "://" in url else f"http://{url}")
        settings = {
            "host": parsed.hostname or "127.0.0.1",
            "port": parsed.port or 2379,
            # etcd's own authentication: http://user:password@host:2379
            "username": unquote(parsed.username) if parsed.username else None,
            "password": unquote(parsed.password) if parsed.password else None,
            "timeout": timeout,
            "options": _GRPC_OPTIONS,
        }
        self._client = (
            _TlsClient(_tls_credentials(), **settings)
            if parsed.scheme == "https"
            else aetcd.Client(**settings)
        )
        self._root = namespace_root(namespace)
        self._leased: dict[str, bytes] = {}
        self._lease_id: int | None = None
        self._unsynced = False  # a leased put failed: write every leased key again when possible
        self._lease_lock = asyncio.Lock()
        self._keepalive: asyncio.Task[None] | None = None
        self._closed = False
        self._warn = ThrottledWarning(log)  # an outage fails every retry

    # ------------------------------------------------------------------ key-value

    async def put(self, key: str, value: bytes, leased: bool = False) -> None:
        with _unavailable_on_error():
            if not leased:
                self._leased.pop(key, None)
                await self._client.put(self._full(key), value)
                return
            # Remembered before the write: if etcd is away, the keep-alive loop writes it later
            # (the caller still hears DiscoveryUnavailable now).
            self._leased[key] = value
            try:
                lease = await self._ensure_lease()
                await self._client.put(self._full(key), value, lease=lease)
            except aetcd.ClientError:
                self._unsynced = True
                raise

    async def get(self, key: str) -> bytes | None:
        with _unavailable_on_error():
            found = await self._client.get(self._full(key))
        return None if found is None else found.value

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        with _unavailable_on_error():
            found = await self._client.get_prefix(self._full(prefix))
        return {self._relative(kv.key): kv.value for kv in found}

    async def delete(self, key: str) -> None:
        self._leased.pop(key, None)
        with _unavailable_on_error():
            await self._client.delete(self._full(key))

    async def watch_prefix(self, prefix: str) -> AsyncIterator[KeyEvent]:
        known: dict[str, bytes] = {}
        delay = 0.1
        while not self._closed:
            watch: aetcd.Watch | None = None
            try:
                listed = await self._client.get_prefix(self._full(prefix))
                current = {self._relative(kv.key): kv.value for kv in listed}
                for key in [k for k in known if k not in current]:
                    del known[key]
                    yield KeyEvent("delete", key, None)
                for key, value in current.items():
                    if known.get(key) != value:
                        known[key] = value
                        yield KeyEvent("put", key, value)
                watch = await self._client.watch_prefix(
                    self._full(prefix), start_revision=listed.header.revision + 1
                )
                delay = 0.1
                async for event in watch:
                    key = self._relative(event.kv.key)
                    if event.kind == "PUT":
                        # Writing a key again with its value (a lease restore does) changes nothing.
                        if known.get(key) != event.kv.value:
                            known[key] = event.kv.value
                            yield KeyEvent("put", key, event.kv.value)
                    elif known.pop(key, None) is not None:
                        yield KeyEvent("delete", key, None)
            except aetcd.ClientError as exc:
                self._warn(f"etcd watch on {prefix!r} broke ({exc!r}); keeping {len(known)} known keys")
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
            finally:
                # After close() the client has dropped its watcher: nothing left to cancel.
                if watch is not None and not self._closed:
                    with contextlib.suppress(aetcd.ClientError):
                        await watch.cancel()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
        if self._lease_id is not None:
            # Revoking removes our keys now rather than a TTL later; best effort if etcd is away.
            with contextlib.suppress(aetcd.ClientError, TimeoutError):
                await asyncio.wait_for(self._client.revoke_lease(self._lease_id), 2.0)
        await self._client.close()

    # ------------------------------------------------------------------ lease

    async def _ensure_lease(self) -> int:
        async with self._lease_lock:
            if self._lease_id is None:
                lease = await self._client.lease(max(1, math.ceil(self.ttl)))
                self._lease_id = lease.id
            if self._keepalive is None:
                self._keepalive = asyncio.create_task(self._keep_alive(), name="etcd-keepalive")
            return self._lease_id

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                reply = None
                if self._lease_id is not None:
                    reply = await self._client.refresh_lease(self._lease_id)
                if reply is None or reply.TTL <= 0:
                    await self._restore(new_lease=True)
                elif self._unsynced:
                    await self._restore(new_lease=False)
            except aetcd.ClientError as exc:
                self._warn(f"etcd lease keep-alive failed ({exc!r}); retrying")

    async def _restore(self, new_lease: bool) -> None:
        """Write every leased key again, under a new lease if the old one is gone."""
        if new_lease:
            async with self._lease_lock:
                self._lease_id = None
                self._lease_id = (await self._client.lease(max(1, math.ceil(self.ttl)))).id
        self._unsynced = False
        try:
            for key, value in list(self._leased.items()):
                await self._client.put(self._full(key), value, lease=self._lease_id)
        except aetcd.ClientError:
            self._unsynced = True
            raise
        log.info("etcd registrations restored (%d keys, new lease: %s)", len(self._leased), new_lease)

    # ------------------------------------------------------------------ helpers

    def _full(self, key: str) -> bytes:
        return (self._root + key).encode()

    def _relative(self, key: bytes) -> str:
        return key.decode()[len(self._root) :]
