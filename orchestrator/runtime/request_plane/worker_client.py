"""Typed calls to a worker: what the frontend and the router use.

`TcpWorkerClient` goes over the request plane (endpoints `generate`: msgpack `WorkerRequest`
in, msgpack `TokenDelta`s out; `kv_snapshot` and `model_files`: one struct out). In embedded
mode the `WorkerHost` itself is the client. Either raises `EngineError` for every failure and
cancels the request when the delta stream is closed early.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from orchestrator.runtime.engine import DeltaStream
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import KvSnapshot, ModelFiles, TokenDelta, WorkerRequest, merge_deltas
from orchestrator.runtime.request_plane.client import RequestPlaneClient, ResponseStream

GENERATE = "generate"
KV_SNAPSHOT = "kv_snapshot"
MODEL_FILES = "model_files"
# The KV data plane (orchestrator/runtime/kv_transfer.py): a prefill worker's held KV records.
KV_BLOCKS = "kv_blocks"

_encode = msgspec.msgpack.Encoder().encode
_decode_delta = msgspec.msgpack.Decoder(TokenDelta).decode
_decode_snapshot = msgspec.msgpack.Decoder(KvSnapshot).decode
_decode_model_files = msgspec.msgpack.Decoder(ModelFiles).decode


class WorkerClient(Protocol):
    def generate(self, request: WorkerRequest) -> DeltaStream: ...

    async def kv_snapshot(self) -> KvSnapshot: ...

    async def model_files(self) -> ModelFiles: ...


class _DeltaStream:
    """Decodes a response stream into TokenDeltas; a plain class, so no generator frame per item.

    Frames that arrived together (the worker got ahead of the caller) come out as one merged
    delta, so the caller detokenizes and writes once per burst instead of once per frame."""

    __slots__ = ("_inner",)

    def __init__(self, inner: ResponseStream) -> None:
        self._inner = inner

    def __aiter__(self) -> _DeltaStream:
        return self

    async def __anext__(self) -> TokenDelta:
        payload = await self._inner.__anext__()
        more = self._inner.drain_ready()
        try:
            if not more:
                return _decode_delta(payload)
            return merge_deltas([_decode_delta(payload), *map(_decode_delta, more)])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self._inner.aclose()
            raise EngineError("internal", f"undecodable delta from worker: {exc}") from exc

    async def aclose(self) -> None:
        await self._inner.aclose()


class TcpWorkerClient:
    def __init__(self, client: RequestPlaneClient, address: str) -> None:
        self.client = client
        self.address = address

    def generate(self, request: WorkerRequest) -> _DeltaStream:
        return _DeltaStream(self.client.stream(self.address, GENERATE, _encode(request)))

    async def kv_snapshot(self) -> KvSnapshot:
        return _decode_snapshot(await self._call(KV_SNAPSHOT))

    async def model_files(self) -> ModelFiles:
        return _decode_model_files(await self._call(MODEL_FILES))

    async def _call(self, endpoint: str) -> bytes:
        """The one payload a single-answer endpoint sends."""
        stream = self.client.stream(self.address, endpoint, b"")
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            raise EngineError("internal", f"worker sent no answer to {endpoint}") from None
        finally:
            await stream.aclose()
