"""`RemoteRouter`: a standalone router (`weir router`) asked for each decision over the
request plane, behind the same `select` / `on_finish` a local `Router` offers.

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

from orchestrator.runtime.request_plane import RemoteError, RequestPlaneClient
from router.avoid import select_avoiding
from router.endpoints import FINISH, ROUTE, FinishCall, RouteAnswer, RouteCall
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
        self._remote: dict[str, str] = {}  # request id -> worker, for requests the router placed
        self._finishing: set[asyncio.Task[None]] = set()

    async def select(self, request: RouteRequest, avoid: Collection[str] = ()) -> Decision:
        if self._clock() >= self._retry_at:
            answer = await self._ask(request, avoid)
            if answer is not None:
                if answer.worker_id in self.fallback.workers:
                    self._remote[request.request_id] = answer.worker_id
                    return Decision(
                        answer.worker_id, answer.overlap_blocks, answer.cost, answer.best_overlap_blocks
                    )
                self._send_finish(answer.worker_id, request.request_id)
        return select_avoiding(self.fallback, request, avoid)

    def on_finish(self, worker_id: str, request_id: str | None = None) -> None:
        if request_id is not None and self._remote.pop(request_id, None) == worker_id:
            self._send_finish(worker_id, request_id)
        else:
            self.fallback.on_finish(worker_id, request_id)

    async def close(self) -> None:
        for task in list(self._finishing):
            task.cancel()
        await asyncio.gather(*self._finishing, return_exceptions=True)

    async def _ask(self, request: RouteRequest, avoid: Collection[str]) -> RouteAnswer | None:
        call = RouteCall(
            model=self.model,
            request_id=request.request_id,
            num_tokens=request.num_tokens,
            block_hashes=request.block_hashes,
            pinned_worker=request.pinned_worker,
            avoid=list(avoid),
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                return _decode_answer(await self._call(ROUTE, _encode(call)))
        except RemoteError as exc:
            if exc.retryable:  # the connection, not the router's answer: give it time
                self._unreachable(exc)
            else:
                log.info(
                    "router %s refused %s (%s); placing it locally", self.address, request.request_id, exc
                )
        except TimeoutError as exc:
            self._unreachable(exc)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("undecodable answer from router %s: %s", self.address, exc)
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

    async def _call(self, endpoint: str, payload: bytes) -> bytes:
        """The one payload `endpoint` answers with (b"" for none)."""
        stream = self.client.stream(self.address, endpoint, payload)
        try:
            return await anext(stream, b"")
        finally:
            await stream.aclose()

    def _send_finish(self, worker_id: str, request_id: str) -> None:
        call = FinishCall(model=self.model, request_id=request_id, worker_id=worker_id)
        task = asyncio.get_running_loop().create_task(self._finish(call))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish(self, call: FinishCall) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._call(FINISH, _encode(call))
        except (RemoteError, TimeoutError) as exc:  # a restarted router never counted it anyway
            log.debug("finish of %s not delivered to router %s: %r", call.request_id, self.address, exc)
