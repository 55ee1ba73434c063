"""Request bodies -> request models, large ones in a process of their own.

Validating JSON holds the GIL throughout, and its cost per byte depends on the body's shape:
on this project's 2-core machines a 10 MB body took 0.3 s as a list of two million strings,
1.4 s as a `logit_bias` of 800,000 keys and 3.4 s as a list of 1.6 million one-item lists.
On the event loop that would hold /health and every other stream for as long. A thread would
not help (the GIL), so bodies of at least `OFFLOAD_BYTES` are validated in one child process,
started on first use and shared by the app: hostile bodies queue behind each other there
instead of taking the loop, or every core. Legitimate requests that large are rare (a prompt
of 250,000 token ids); theirs is the price of one pickle round trip. A rejected body comes
back as its error alone, never its input, which pydantic's errors hold in full.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

import pydantic

from orchestrator.frontend.errors import InvalidRequest, to_frontend_error
from orchestrator.frontend.protocol import ChatCompletionRequest, CompletionRequest

# Below this a body validates within about 25 ms whatever its shape (the worst seen, ~400 ns
# per byte), so it stays on the loop; chat requests of ordinary length are well below it.
OFFLOAD_BYTES = 64 * 1024

Request = TypeVar("Request", ChatCompletionRequest, CompletionRequest)
# (message, param, code) of the InvalidRequest the body earned.
_Rejection = tuple[str, str | None, str | None]


def _validate(model: type[Request], body: bytes) -> Request | _Rejection:
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        err = to_frontend_error(exc)
        return err.message, err.param, err.code


class BodyParser:
    def __init__(self, offload_bytes: int = OFFLOAD_BYTES) -> None:
        self.offload_bytes = offload_bytes
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, model: type[Request], body: bytes) -> Request:
        """`body` validated as `model`; InvalidRequest (400) for any body it does not describe."""
        if len(body) < self.offload_bytes:
            return model.model_validate_json(body)
        if self._pool is None:
            # spawn: the frontend may run engine threads (weir serve) that a fork would copy mid-step.
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        pool = self._pool
        try:
            result = await asyncio.wrap_future(pool.submit(_validate, model, body))
        except BrokenProcessPool:
            # The child died on this body (out of memory, say): the next large body gets a new one.
            if self._pool is pool:
                self._pool = None
            raise InvalidRequest("The request body could not be validated.") from None
        if isinstance(result, tuple):
            raise InvalidRequest(*result)
        return result

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, cancel_futures=True)
