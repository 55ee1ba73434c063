"""Serves one `Engine` as a worker: request plane, discovery, KV events, load, drain.

Endpoints on the request plane: `generate` (msgpack WorkerRequest -> msgpack TokenDelta
stream; an EngineError becomes a typed error frame), `kv_snapshot` (-> one KvSnapshot),
`model_files` (-> one ModelFiles: the card's tokenizer files, for a frontend on another disk)
and `kv_blocks` (a held KV transfer's records, for a decode worker: kv_transfer.py). The
first three are typed methods (`generate`, `kv_snapshot`, `model_files`), so an in-process
frontend (`weir serve`) calls the host as a `WorkerClient`, drain and metrics included,
without the TCP hop.

Disaggregation goes through `generate`, so in-process callers get it too. The last delta of
a prefill-only request carries the engine's `KvTransfer`; the host fills in where to pull it
(instance id, request-plane address, host id) and holds it for one pull or `kv_hold_s`
(kv_transfer_server.py). A request with `kv_transfer` goes to
`engine.generate(request, arriving_kv)` at once, with the pull of its records from that
worker as `arriving_kv`, not started: the engine queues the request as waiting for its KV,
runs the pull, loads what arrived and recomputes whatever is missing; an engine that cannot
load KV never starts it, and the host closes it. The pull takes shared memory on one host,
else the host's `kv_fabric` when both workers run one, else TCP; the call always goes over the
request plane with the host's own `PlaneSecurity`; at most `kv_pull_timeout_s`; cancelling the
request stops it.

Every ~15 ms the host takes the engine's KV event batches and publishes them on
`subject(ns, model, "kv")`, and publishes a LoadReport on `.load` when it changed or a second
has passed. Batches lost in transit show up as an `event_id` gap; routers then ask for the
snapshot.

Draining (`drain()`, the control key `drain/<instance_id>`, or SIGTERM via `serve_workers`):
the instance is re-registered with `draining=True`, new `generate` calls get
`WorkerError(code="overloaded", retryable=True)`, in-flight requests finish, then the leased
key `drained/<instance_id>` is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine, Sequence
from typing import Any

import msgspec

from orchestrator.runtime import worker_metrics as metrics
from orchestrator.runtime.discovery import Discovery, DiscoveryUnavailable, drain_key, drained_key
from orchestrator.runtime.engine import DeltaStream, Engine
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.hashing import block_hashes, prompt_block_names
from orchestrator.runtime.kv_fabric import KvFabric
from orchestrator.runtime.kv_transfer import host_id
from orchestrator.runtime.kv_transfer_client import pull_kv
from orchestrator.runtime.kv_transfer_server import DEFAULT_HOLD_S, KvTransferServer
from orchestrator.runtime.model_files import read_model_files
from orchestrator.runtime.protocol import (
    Instance,
    KvSnapshot,
    LoadReport,
    ModelFiles,
    TokenDelta,
    WorkerRequest,
    subject,
)
from orchestrator.runtime.request_plane import (
    GENERATE,
    KV_BLOCKS,
    KV_SNAPSHOT,
    MODEL_FILES,
    PlaneSecurity,
    RequestPlaneClient,
    RequestPlaneServer,
    dial_address,
)
from orchestrator.runtime.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(WorkerRequest).decode
LOAD_HEARTBEAT_S = 1.0
DEFAULT_KV_PULL_TIMEOUT_S = 10.0


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


class WorkerHost:
    def __init__(
        self,
        engine: Engine,
        discovery: Discovery,
        events: EventPlane,
        namespace: str,
        host: str = "127.0.0.1",
        port: int = 0,
        instance_id: str | None = None,
        advertise_host: str | None = None,
        publish_interval: float = 0.015,
        security: PlaneSecurity | None = None,
        kv_hold_s: float = DEFAULT_HOLD_S,
        kv_pull_timeout_s: float = DEFAULT_KV_PULL_TIMEOUT_S,
        kv_fabric: KvFabric | None = None,
    ) -> None:
        self.engine = engine
        self.discovery = discovery
        self.events = events
        self.namespace = namespace
        self.host = host
        self.port = port
        self.instance_id = instance_id or default_instance_id()
        self.advertise_host = advertise_host
        self.publish_interval = publish_interval
        self.instance: Instance | None = None
        self.in_flight = 0
        self.draining = False
        self.kv_pull_timeout_s = kv_pull_timeout_s
        self.kv_fabric = kv_fabric  # KV between hosts through a transfer engine (kv_fabric.py)
        self.kv = KvTransferServer(engine, self.instance_id, kv_hold_s, kv_fabric)
        self._server = RequestPlaneServer(
            {
                GENERATE: self._generate,
                KV_SNAPSHOT: self._kv_snapshot,
                MODEL_FILES: self._model_files,
                KV_BLOCKS: self.kv.serve,
            },
            security,
        )
        # Pulls dial other workers as this cluster's member: the same secret and TLS.
        self._kv_client = RequestPlaneClient(security=security)
        self._idle = asyncio.Event()
        self._idle.set()
        self._drained: asyncio.Future[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._warn = ThrottledWarning(log)

    @property
    def address(self) -> str:
        return self.instance.address if self.instance is not None else ""

    @property
    def ready(self) -> bool:
        return self.instance is not None and not self.draining

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.engine.start()
        port = await self._server.start(self.host, self.port)
        address = dial_address(self.host, port, self.advertise_host)
        self.instance = Instance(
            instance_id=self.instance_id, component="worker", address=address, card=self.engine.card
        )
        await self.discovery.register(self.instance)
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name=f"publish-{self.instance_id}"),
            asyncio.create_task(self._watch_drain_key(), name=f"drain-watch-{self.instance_id}"),
        ]
        log.info("worker %s serving %s at %s", self.instance_id, self.engine.card.name, self.address)

    async def drain(self) -> None:
        """Stop taking requests, let in-flight ones finish, then report drained. Idempotent."""
        if self._drained is None:
            self._drained = asyncio.ensure_future(self._drain())
        await asyncio.shield(self._drained)

    async def stop(self) -> None:
        """Leave discovery and stop at once; unfinished requests end with finish_reason 'abort'."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(DiscoveryUnavailable):
            await self.discovery.deregister(self.instance_id)
            # A drain request is for this process only: a restart under a fixed --instance-id
            # must not find it and drain at once.
            await self.discovery.delete(drain_key(self.instance_id))
        await self._server.stop()
        await self._kv_client.close()
        self.kv.close()
        await self.engine.stop()
        metrics.forget(self.instance_id)

    async def _drain(self) -> None:
        self.draining = True
        metrics.DRAINING.labels(self.instance_id).set(1)
        log.info("worker %s draining: %d requests in flight", self.instance_id, self.in_flight)
        if self.instance is not None:
            self.instance = msgspec.structs.replace(self.instance, draining=True)
            with contextlib.suppress(DiscoveryUnavailable):  # written when etcd is back
                await self.discovery.register(self.instance)
        await self._idle.wait()
        with contextlib.suppress(DiscoveryUnavailable):
            await self.discovery.put(drained_key(self.instance_id), b"", leased=True)
        log.info("worker %s drained", self.instance_id)

    # ------------------------------------------------------------------ serving

    async def generate(self, request: WorkerRequest) -> AsyncGenerator[TokenDelta, None]:
        """One request through the host: refused while draining, counted in flight and in the
        metrics. In-process callers (`weir serve`) use it directly, so the host is a
        `WorkerClient`; the `generate` endpoint decodes into it."""
        if self.draining:
            metrics.REQUESTS.labels(self.instance_id, "rejected").inc()
            raise EngineError("overloaded", f"worker {self.instance_id} is draining", retryable=True)
        self.in_flight += 1
        self._idle.clear()
        outcome = "cancelled"
        stream: DeltaStream | None = None
        arriving: Coroutine[Any, Any, list[bytes | memoryview]] | None = None
        try:
            if request.kv_transfer is None:
                # Engines that predate disaggregation take no `arriving_kv`.
                stream = self.engine.generate(request)
            else:
                arriving = pull_kv(
                    self._kv_client,
                    request.kv_transfer,
                    self.kv_pull_timeout_s,
                    worker_id=self.instance_id,
                    fabric=self.kv_fabric,
                )
                stream = self.engine.generate(request, arriving)
            async for delta in stream:
                if delta.kv_transfer is not None:
                    delta.kv_transfer = msgspec.structs.replace(
                        delta.kv_transfer,
                        source_worker=self.instance_id,
                        address=self.address,
                        host_id=host_id(),
                    )
                    self.kv.offer(delta.kv_transfer)
                yield delta
            outcome = "ok"
        except EngineError:
            outcome = "error"
            raise
        finally:
            if stream is not None:
                await stream.aclose()
            if arriving is not None:
                arriving.close()  # an engine that cannot load KV never started the pull
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
            metrics.REQUESTS.labels(self.instance_id, outcome).inc()

    async def kv_snapshot(self) -> KvSnapshot:
        snapshot = self.engine.kv_snapshot()
        snapshot.worker_id = self.instance_id
        return snapshot

    async def model_files(self) -> ModelFiles:
        try:
            return await asyncio.to_thread(read_model_files, self.engine.card.model_path)
        except (OSError, ValueError) as exc:
            raise EngineError("internal", f"cannot read the tokenizer files: {exc}") from exc

    # ------------------------------------------------------------------ endpoints

    async def _generate(self, payload: bytes) -> AsyncGenerator[bytes, None]:
        try:
            request = _decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            metrics.REQUESTS.labels(self.instance_id, "invalid").inc()
            raise EngineError("invalid_request", f"bad WorkerRequest: {exc}") from exc
        try:
            self._check(request)
        except EngineError:
            metrics.REQUESTS.labels(self.instance_id, "invalid").inc()
            raise
        stream = self.generate(request)
        try:
            async for delta in stream:
                yield _encode(delta)
        finally:
            await stream.aclose()

    def _check(self, request: WorkerRequest) -> None:
        """What a caller on the wire could get wrong or forge, checked before the engine sees it.

        Block hashes are recomputed from the tokens, never trusted: the engine's prefix cache
        is keyed on them, so a request carrying another request's hashes would be served that
        request's KV (another tenant's, once tiers are shared). An honest caller computes the
        same hashes, so a mismatch is refused rather than silently replaced: it is a bug or an
        attack, and either should be seen."""
        card = self.engine.card
        # 2**32: the hash reads tokens as u32; an engine that knows its vocabulary says so.
        vocab = card.vocab_size or 2**32
        for name, ids in (
            ("token_ids", request.token_ids),
            ("generated_token_ids", request.generated_token_ids),
            ("stop_token_ids", request.stop_token_ids),
        ):
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise EngineError("invalid_request", f"{name} holds ids outside the vocabulary [0, {vocab})")
        # A migrated request prefills its prompt and the tokens already generated, and its
        # hashes cover both (frontend/dispatch.py extends them).
        tokens = [*request.token_ids, *request.generated_token_ids]
        if len(tokens) > card.context_length:
            raise EngineError(
                "invalid_request",
                f"{len(tokens)} prompt and generated tokens exceed the context length {card.context_length}",
            )
        hashes = block_hashes(tokens, card.block_size, request.cache_salt)
        if request.block_hashes and request.block_hashes != hashes:
            raise EngineError("invalid_request", "block_hashes do not match the request's tokens")
        request.block_hashes = hashes
        # A decode pulls at most the transfer's blocks: they must be this request's own
        # prompt blocks (the last may be its partial one), which also bounds how much a forged
        # descriptor can make it pull.
        transfer = request.kv_transfer
        if (
            transfer is not None
            and transfer.block_hashes
            != prompt_block_names(request.token_ids, card.block_size, request.cache_salt)[
                : len(transfer.block_hashes)
            ]
        ):
            raise EngineError(
                "invalid_request", "kv_transfer.block_hashes are not the request's prompt blocks"
            )

    async def _kv_snapshot(self, payload: bytes) -> AsyncGenerator[bytes, None]:
        yield _encode(await self.kv_snapshot())

    async def _model_files(self, payload: bytes) -> AsyncGenerator[bytes, None]:
        yield _encode(await self.model_files())

    # ------------------------------------------------------------------ background

    async def _publish_loop(self) -> None:
        card = self.engine.card
        kv_subject = subject(self.namespace, card.name, "kv")
        load_subject = subject(self.namespace, card.name, "load")
        last: LoadReport | None = None
        last_sent = 0.0
        # The id of the last batch taken from the engine, sent or not: load reports carry it so
        # a router notices a lost final batch, which no later batch would reveal as a gap.
        kv_event_id = 0
        while True:
            await asyncio.sleep(self.publish_interval)
            try:
                for batch in self.engine.take_kv_events():
                    batch.worker_id = self.instance_id
                    kv_event_id = batch.event_id
                    await self.events.publish(kv_subject, _encode(batch))
                    metrics.KV_EVENTS_PUBLISHED.labels(self.instance_id).inc(len(batch.events))
                load = self.engine.load()
                load.worker_id = self.instance_id
                load.draining = self.draining
                load.kv_event_id = kv_event_id
                metrics.observe_load(load, self.in_flight)
                now = time.monotonic()
                if load != last or now - last_sent >= LOAD_HEARTBEAT_S:
                    await self.events.publish(load_subject, _encode(load))
                    last, last_sent = msgspec.structs.replace(load), now
            except Exception as exc:  # the event plane is best effort: never stop serving for it
                self._warn("worker %s: publishing events failed: %r", self.instance_id, exc)

    async def _watch_drain_key(self) -> None:
        key = drain_key(self.instance_id)
        async for event in self.discovery.watch_prefix(key):
            if event.key == key and event.kind == "put":
                await self.drain()
                return


async def serve_workers(
    hosts: Sequence[WorkerHost],
    metrics_port: int | None = None,
    metrics_host: str = "0.0.0.0",
    drain_timeout: float = 60.0,
) -> None:
    """Run worker hosts until SIGTERM or SIGINT, then drain them (up to `drain_timeout`) and
    stop. With `metrics_port`, also serve /health, /live and /metrics for the process."""
    from orchestrator.runtime.health import HealthServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    health = HealthServer(lambda: all(h.ready for h in hosts))
    try:
        if metrics_port is not None:
            await health.start(metrics_host, metrics_port)
        for host in hosts:
            await host.start()
        await stop.wait()
        log.info("stopping: draining %d workers (up to %.0f s)", len(hosts), drain_timeout)
        try:
            await asyncio.wait_for(asyncio.gather(*(h.drain() for h in hosts)), drain_timeout)
        except TimeoutError:
            log.warning("drain timed out after %.0f s; aborting what is left", drain_timeout)
    finally:
        for host in hosts:
            await host.stop()
        await health.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
