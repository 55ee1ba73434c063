"""Graceful shutdown of the generation routes.

On SIGTERM (`server.FrontendServer.shutdown`) the frontend stops listening and `begin()`s:
`/health` answers 503 and a new generation request gets 503 `shutting_down`. The requests in
flight get `drain_timeout_s` to finish; `cut()` then cancels the rest, and each handler, seeing
its task in `cut_tasks`, ends its response with an error (an SSE error event and `[DONE]`, or a
503 body), never a silently closed connection."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("weir.frontend")
# How long cut handlers get to write their error and close their worker streams.
_CUT_GRACE_S = 5.0


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self._tasks: set[asyncio.Task[object]] = set()
        self.cut_tasks: set[asyncio.Task[object]] = set()

    def track(self, task: asyncio.Task[object]) -> None:
        self._tasks.add(task)

    def untrack(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        self.cut_tasks.discard(task)

    def begin(self) -> None:
        self.draining = True

    async def wait(self, timeout_s: float) -> None:
        """Let the tracked requests finish within `timeout_s`, then end the rest with an error."""
        if not self._tasks:
            return
        log.info("draining %d in-flight requests (at most %g s)", len(self._tasks), timeout_s)
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        if not pending:
            return
        log.warning("drain timeout: ending %d requests with an error", len(pending))
        for task in pending:
            self.cut_tasks.add(task)
            task.cancel()
        await asyncio.wait(pending, timeout=_CUT_GRACE_S)
