"""Selecting while some workers are off limits for one request (they just failed it)."""

from __future__ import annotations

from collections.abc import Collection

from router.protocols import Decision, RouteRequest
from router.router import Router


def select_avoiding(router: Router, request: RouteRequest, avoid: Collection[str] = ()) -> Decision:
    """`router.select`, with the `avoid` workers hidden for this call only.

    The router has no exclusion list: the avoided workers are marked draining for this one
    synchronous call (no await in between, so no other request sees it)."""
    if not avoid:
        return router.select(request)
    previous = {w: router.workers[w].draining for w in avoid if w in router.workers}
    for worker_id in previous:
        router.set_draining(worker_id, True)
    try:
        return router.select(request)
    finally:
        for worker_id, draining in previous.items():
            router.set_draining(worker_id, draining)
