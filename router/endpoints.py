"""The standalone router's request-plane endpoint and its msgpack messages.

`route`: one `RouteCall` in, one `RouteAnswer` out, or a typed error when no worker can take
the request (`unavailable`) or the router knows no worker of the model or cannot read the
call (`invalid_request`). After the answer the stream stays open while the request runs:
the caller closes it (a Cancel frame) when the request ends, and that releases the request's
in-flight load on the router. A caller that dies or loses its connection so releases all of
its requests at once, which an explicit "finish" call could never do. Answered by
`router.service.RouterService`, asked by `router.remote.RemoteRouter`."""

from __future__ import annotations

import msgspec

ROUTE = "route"


class RouteCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    request_id: str
    num_tokens: int
    block_hashes: list[int] = []
    pinned_worker: str | None = None  # `direct` mode
    # Workers that already failed this request (on the wire as "avoid", its first name).
    exclude: list[str] = msgspec.field(default_factory=list, name="avoid")


class RouteAnswer(msgspec.Struct, kw_only=True):
    worker_id: str
    address: str  # the worker's request-plane address
    overlap_blocks: int = 0
    best_overlap_blocks: int = 0
    cost: float = 0.0
