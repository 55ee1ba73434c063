"""`RemoteRouter`: a standalone router (`weir router`) asked for each decision over the
request plane, behind the same `select` / `on_finish` a local `Router` offers.

Each decision's `route` stream stays open while its request runs; `on_finish` closes it,
which releases the request's load on the router (`router.endpoints`).

When the router cannot be reached (connection refused or lost, no answer within
`timeout_s`), the request is placed by `fallback`, a local `Router` over the same workers,
and the remote router is tried again after `retry_s`: requests keep flowing, only without
the shared KV index. A typed refusal from the router (no worker, a model it does not know
yet) falls back for that request alone. A decision naming a worker this frontend does not
know yet (discovery reaches the two at different moments) is released and placed locally."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

import msgspec

from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.request_plane import RequestPlaneClient, ResponseStream
from router.endpoints import ROUTE, RouteAnswer, RouteCall
from router.protocols import Decision, RouteRequest
from router.router import Router

log = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode
_decode_answer = msgspec.msgpack.Decoder(RouteAnswer).decode


class RemoteRouter:
    def __init__(
        self,
        client: RequestPlaneClient,
        address: str,
        model: str,
        fallback: Router,
        *,
        timeout_s: float = 2.0,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.address = address
        self.model = model
        self.fallback = fallback
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._clock = clock
        self._retry_at = 0.0
        # requests the router placed: request id -> (worker, the open route stream)
        self._placed: dict[str, tuple[str, ResponseStream]] = {}

    async def select(self, request: RouteRequest, exclude: Collection[str] = ()) -> Decision:
        if self._clock() >= self._retry_at:
            placed = await self._ask(request, exclude)
            if placed is not None:
                answer, stream = placed
                if answer.worker_id in self.fallback.workers:
                    self._placed[request.request_id] = (answer.worker_id, stream)
                    return Decision(
                        answer.worker_id, answer.overlap_blocks, answer.cost, answer.best_overlap_blocks
                    )
                stream.close()
        return self.fallback.select(request, exclude)

    def on_finish(self, worker_id: str, request_id: str | None = None) -> None:
        placed = self._placed.pop(request_id, None) if request_id is not None else None
        if placed is None:
            self.fallback.on_finish(worker_id, request_id)
        else:
            placed[1].close()

    def close(self) -> None:
        for _, stream in self._placed.values():
            stream.close()
        self._placed.clear()

    async def _ask(
        self, request: RouteRequest, exclude: Collection[str]
    ) -> tuple[RouteAnswer, ResponseStream] | None:
        call = RouteCall(
            model=self.model,
            request_id=request.request_id,
            num_tokens=request.num_tokens,
            block_hashes=request.block_hashes,
            pinned_worker=request.pinned_worker,
            exclude=list(exclude),
        )
        stream = self.client.stream(self.address, ROUTE, _encode(call))
        try:
            async with asyncio.timeout(self.timeout_s):
                return _decode_answer(await anext(stream)), stream
        except EngineError as exc:
            if exc.retryable:  # the connection, not the router's answer: give it time
                self._unreachable(exc)
            else:
                log.info(
                    "router %s refused %s (%s); placing it locally", self.address, request.request_id, exc
                )
        except TimeoutError as exc:
            self._unreachable(exc)
        except (StopAsyncIteration, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("no usable answer from router %s: %r", self.address, exc)
        stream.close()
        return None

    def _unreachable(self, exc: Exception) -> None:
        self._retry_at = self._clock() + self.retry_s
        log.warning(
            "router %s unreachable (%r): routing %s locally for %.1f s",
            self.address,
            exc,
            self.model,
            self.retry_s,
        )
