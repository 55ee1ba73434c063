"""The standalone router's request-plane endpoints and their msgpack messages.

`route`: one `RouteCall` in, one `RouteAnswer` out; a typed error when no worker can take
the request (`unavailable`) or the router knows no worker of the model or cannot read the
call (`invalid_request`). `finish`: one `FinishCall` in, nothing out; it releases the
request's in-flight load on the router. Both are answered by `router.service.RouterService`
and asked by `router.remote.RemoteRouter`."""

from __future__ import annotations

import msgspec

ROUTE = "route"
FINISH = "finish"


class RouteCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    request_id: str
    num_tokens: int
    block_hashes: list[int] = []
    pinned_worker: str | None = None  # `direct` mode
    avoid: list[str] = []  # workers that already failed this request


class RouteAnswer(msgspec.Struct, kw_only=True):
    worker_id: str
    address: str  # the worker's request-plane address
    overlap_blocks: int = 0
    best_overlap_blocks: int = 0
    cost: float = 0.0


class FinishCall(msgspec.Struct, kw_only=True):
    model: str
    request_id: str
    worker_id: str
