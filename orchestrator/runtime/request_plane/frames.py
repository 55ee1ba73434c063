"""Request-plane wire format.

Each frame on the TCP stream is a big-endian u32 length followed by that many bytes of
msgpack: an array whose first element is the frame's integer tag (msgspec tagged union of
`array_like` structs, so no field names travel). Caller to server: `Call`, `Cancel`;
server to caller: `Data`*, then `End` or `Error`. Stream ids are chosen by the caller,
unique per connection, and many streams interleave on one connection.
"""

from __future__ import annotations

import struct

import msgspec

from orchestrator.runtime.protocol import WorkerError

MAX_FRAME_BYTES = 64 * 1024 * 1024
_HEADER = struct.Struct(">I")


class Call(msgspec.Struct, tag=1, array_like=True):
    """Open stream `stream_id`: run `endpoint` on `payload`. -> [1, stream_id, endpoint, payload]"""

    stream_id: int
    endpoint: str
    payload: bytes


class Cancel(msgspec.Struct, tag=2, array_like=True):
    """The caller lost interest: stop the handler. -> [2, stream_id]"""

    stream_id: int


class Data(msgspec.Struct, tag=3, array_like=True):
    """One item of the response stream. -> [3, stream_id, payload]"""

    stream_id: int
    payload: bytes


class End(msgspec.Struct, tag=4, array_like=True):
    """The response stream finished normally. -> [4, stream_id]"""

    stream_id: int


class Error(msgspec.Struct, tag=5, array_like=True):
    """The response stream failed. -> [5, stream_id, {code, message, retryable}]"""

    stream_id: int
    error: WorkerError


Frame = Call | Cancel | Data | End | Error

_encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Frame)


def append_frame(buf: bytearray, frame: Frame) -> None:
    """Append `frame`, length-prefixed, to `buf` without intermediate copies."""
    start = len(buf)
    buf += b"\0\0\0\0"
    try:
        _encoder.encode_into(frame, buf, start + 4)
    except BaseException:
        del buf[start:]  # never leave half a frame in a shared write buffer
        raise
    _HEADER.pack_into(buf, start, len(buf) - start - 4)


def data_header(stream_id: int, size: int) -> bytes:
    """What precedes a `size`-byte payload in the encoding of `Data(stream_id, payload)`: the
    length prefix, the array header, the tag, the stream id and a bin32 header. Lets a large
    payload be written as is after it, never copied into a frame."""
    body = b"\x93\x03" + _encoder.encode(stream_id) + b"\xc6" + size.to_bytes(4, "big")
    return _HEADER.pack(len(body) + size) + body


def encode_frame(frame: Frame) -> bytes:
    buf = bytearray()
    append_frame(buf, frame)
    return bytes(buf)


def stream_id_of(raw: bytes | memoryview) -> int | None:
    """Best effort: the stream id of a frame that did not decode, to answer it with an error."""
    try:
        items = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    if isinstance(items, list) and len(items) > 1 and type(items[1]) is int:
        return items[1]
    return None
