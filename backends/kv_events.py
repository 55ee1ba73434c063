"""An engine's own KV events, as Weir's router keys them.

vLLM and SGLang publish their prefix cache's changes over ZMQ: a PUB socket sends frames
`[topic, seq (8-byte big-endian), msgpack [ts, [events], dp_rank]]`, and a ROUTER socket
replays buffered frames from a given seq to a subscriber that missed some. Their block hashes
are their own (SHA-256 or Python `hash` chains over their extra keys), so the router cannot
match a prompt against them. `KvMirror` re-derives Weir's sequence hash of every stored block
from the `token_ids` the event carries (`orchestrator.runtime.hashing`), keeps the engine's
hash -> Weir's hash map (the engine's later `BlockRemoved` names only its own hash), and turns
each engine batch into one `KvEventBatch`. `ZmqKvEvents` is the subscriber that feeds it.

What cannot be translated is left out, never guessed: blocks of another size than the card's
(vLLM's partial-block events), of another KV cache group than the first (hybrid models), of a
LoRA adapter or with multimodal or prompt-embedding keys (Weir's hash has no place for them),
and blocks whose parent the mirror never saw. The router then misses those blocks' prefix
credit, which costs cache hits, never correctness.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
    Tier,
)
from orchestrator.runtime.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)

# An engine's storage medium -> Weir's tier. vLLM's GPU pool is "GPU" (its CPU build too);
# its offloading connectors report "CPU" and "STORAGE". SGLang's HiCache reports
# "CPU_PINNED", "DISK" and "EXTERNAL" (a storage backend its instances share, as Weir's
# remote tier is).
_TIERS: dict[str | None, Tier] = {
    None: "device",
    "GPU": "device",
    "CPU": "host",
    "CPU_PINNED": "host",
    "STORAGE": "disk",
    "DISK": "disk",
    "EXTERNAL": "remote",
}

# Positional field order of events encoded as arrays (msgspec array_like structs: SGLang's,
# and vLLM's before it gave its events map form); the first element is the tag.
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def event_fields(event: Any) -> dict[str, Any] | None:
    """One decoded engine event as a field map with its type under "type", whether it was
    encoded as a map (vLLM >= 0.11) or as a tagged array; None for anything else."""
    if isinstance(event, Mapping):
        return dict(event) if isinstance(event.get("type"), str) else None
    if isinstance(event, list | tuple) and event and isinstance(event[0], str):
        names = _ARRAY_FIELDS.get(event[0])
        if names is None:
            return {"type": event[0]}
        return {"type": event[0], **dict(zip(names, event[1:], strict=False))}
    return None


def decode_batch(payload: bytes) -> list[dict[str, Any]]:
    """The events of one published frame's payload, `[ts, [events], dp_rank]`, as field maps.
    A payload that is not such a batch raises ValueError."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a msgpack KV event batch: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("a KV event batch is [ts, [events], dp_rank]")
    return [fields for event in batch[1] if (fields := event_fields(event)) is not None]


def _salt(event: Mapping[str, Any]) -> tuple[bool, str | None]:
    """(translatable, cache salt) of a chain's first block. SGLang names it `cache_salt`;
    vLLM puts it in the first block's extra keys, untagged: a bare string is a cache salt (or
    a LoRA name, refused before this), a tuple a multimodal (identifier, offset) pair, bytes a
    prompt-embedding digest."""
    if isinstance(event.get("cache_salt"), str):
        return True, event["cache_salt"]
    extra_keys = event.get("extra_keys")
    if not extra_keys or not extra_keys[0]:
        return True, None
    keys = extra_keys[0]
    if len(keys) == 1 and isinstance(keys[0], str):
        return True, keys[0]
    return False, None


class KvMirror:
    """What an engine caches, in Weir's sequence hashes, from the engine's events.

    `apply` takes one engine batch (field maps, see `decode_batch`) and queues one Weir batch;
    `take_events` drains them, numbered 1, 2, 3, ...; `snapshot` is every block mirrored, as
    of the last batch queued. Not thread-safe: one owner calls all three."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._weir: dict[tuple[Tier, Hashable], int] = {}  # (tier, engine hash) -> Weir hash
        self._batches: list[KvEventBatch] = []
        self._event_id = 0
        self.untranslated_blocks = 0  # blocks left out (see the module docstring)
        self._warn = ThrottledWarning(log, 60.0)

    def apply(self, events: Iterable[Mapping[str, Any]]) -> None:
        out: list[KvEvent] = []
        for event in events:
            kind = event.get("type")
            if kind == "BlockStored":
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif kind == "BlockRemoved":
                removed = self._removed(event)
                if removed is not None:
                    out.append(removed)
            elif kind == "AllBlocksCleared":
                self._weir.clear()
                out.append(AllCleared())
        if out:
            self._queue(out)

    def lost_events(self) -> None:
        """Events were missed and cannot be replayed: forget everything, and tell the router to.
        Blocks come back as the engine stores (or re-announces) them."""
        self._weir.clear()
        self._queue([AllCleared()])

    def take_events(self) -> list[KvEventBatch]:
        batches, self._batches = self._batches, []
        return batches

    def snapshot(self) -> KvSnapshot:
        blocks: dict[str, list[int]] = {}
        for (tier, _), weir in self._weir.items():
            blocks.setdefault(tier, []).append(weir)
        return KvSnapshot(worker_id="", event_id=self._event_id, blocks=blocks)

    def __len__(self) -> int:
        return len(self._weir)

    # ------------------------------------------------------------------ translation

    def _queue(self, events: list[KvEvent]) -> None:
        self._event_id += 1
        self._batches.append(KvEventBatch(worker_id="", event_id=self._event_id, events=events))

    def _stored(self, event: Mapping[str, Any]) -> BlockStored | None:
        hashes: Sequence[Hashable] = event.get("block_hashes") or []
        tokens: Sequence[int] = event.get("token_ids") or []
        tier = _TIERS.get(event.get("medium"), "device")
        parent = event.get("parent_block_hash")
        parent_weir = None if parent is None else self._weir.get((tier, parent))
        ok, salt = _salt(event) if parent is None else (True, None)
        later_keys = (event.get("extra_keys") or [None])[1:]
        if (
            not hashes
            or event.get("block_size") != self.block_size
            or len(tokens) != len(hashes) * self.block_size
            or event.get("group_idx") not in (None, 0)
            or event.get("lora_name") is not None
            or event.get("lora_id") is not None
            or (parent is not None and parent_weir is None)
            or not ok
            or any(keys for keys in later_keys)
        ):
            self._left_out(len(hashes), event)
            return None
        weir = block_hashes(tokens, self.block_size, salt, parent=parent_weir)
        # A re-announced prefix (vLLM reports prefix-cache hits as stores) is already known:
        # send only what is new, chained to the last known block.
        known = 0
        while known < len(hashes) and (tier, hashes[known]) in self._weir:
            known += 1
        if known == len(hashes):
            return None
        for engine_hash, weir_hash in zip(hashes[known:], weir[known:], strict=True):
            self._weir[(tier, engine_hash)] = weir_hash
        return BlockStored(
            blocks=weir[known:],
            parent_seq_hash=weir[known - 1] if known else parent_weir,
            tier=tier,
        )

    def _removed(self, event: Mapping[str, Any]) -> BlockRemoved | None:
        if event.get("group_idx") not in (None, 0):
            return None
        tier = _TIERS.get(event.get("medium"), "device")
        gone = [
            weir
            for engine_hash in event.get("block_hashes") or []
            if (weir := self._weir.pop((tier, engine_hash), None)) is not None
        ]
        return BlockRemoved(seq_hashes=gone, tier=tier) if gone else None

    def _left_out(self, blocks: int, event: Mapping[str, Any]) -> None:
        self.untranslated_blocks += blocks
        self._warn(
            "KV events: left %d blocks out of the router's index (%d so far), e.g. block_size "
            "%s (card %d), group %s, lora %s; the router gives no prefix credit for them",
            blocks,
            self.untranslated_blocks,
            event.get("block_size"),
            self.block_size,
            event.get("group_idx"),
            event.get("lora_name") or event.get("lora_id"),
        )


class ZmqKvEvents:
    """Subscribes to an engine's ZMQ KV event publisher and feeds a `KvMirror`.

    `poll()` drains what has arrived without blocking (the worker host calls `take_kv_events`
    on its event loop every few milliseconds). A gap in the publisher's sequence numbers is
    filled from its replay socket; if the replay cannot fill it, the mirror is reset
    (`KvMirror.lost_events`). The engine binds both endpoints (ipc:// paths in a private
    directory): nothing else can publish to this subscriber."""

    REPLAY_TIMEOUT_MS = 1000
    _END_SEQ = -1

    def __init__(self, endpoint: str, replay_endpoint: str | None, mirror: KvMirror) -> None:
        import zmq  # vLLM's and SGLang's dependency, not Weir's

        self._zmq = zmq
        self.mirror = mirror
        self._ctx: Any = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)  # before or after the engine binds: zmq connects when it can
        self._replay_endpoint = replay_endpoint
        self._next_seq = 0
        self.bad_frames = 0
        self._warn = ThrottledWarning(log, 60.0)

    def poll(self) -> None:
        zmq = self._zmq
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._frame(frames, replaying=False)

    def close(self) -> None:
        self._sub.close(linger=0)

    def _frame(self, frames: list[bytes], replaying: bool) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bad(f"{len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < self._next_seq:
            return  # already applied (a replay overlaps the live stream)
        if seq > self._next_seq and not replaying and not self._replay(seq):
            self.mirror.lost_events()
        try:
            events = decode_batch(frames[2])
        except ValueError as exc:
            self._bad(str(exc))
            events = []
        self.mirror.apply(events)
        self._next_seq = seq + 1

    def _replay(self, upto: int) -> bool:
        """Fetch and apply the frames from `_next_seq` up to (not including) `upto`; False
        when the publisher no longer holds them all (or does not answer)."""
        if self._replay_endpoint is None:
            return False
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(self._replay_endpoint)
            sock.send_multipart([b"", self._next_seq.to_bytes(8, "big")])
            while sock.poll(self.REPLAY_TIMEOUT_MS):
                # [empty, topic, seq, payload]; SGLang before 0.5 sent no topic.
                reply = sock.recv_multipart()
                seq_bytes, payload = reply[-2], reply[-1]
                topic = reply[1] if len(reply) == 4 else b""
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == self._END_SEQ or seq >= upto:
                    break
                if seq > self._next_seq:
                    return False  # the publisher's buffer starts after what we miss
                self._frame([topic, seq_bytes, payload], replaying=True)
            return self._next_seq >= upto
        except (ValueError, zmq.ZMQError) as exc:
            self._bad(f"replay failed: {exc}")
            return False
        finally:
            sock.close(linger=0)

    def _bad(self, why: str) -> None:
        self.bad_frames += 1
        self._warn("KV events: dropped a frame (%s; %d so far)", why, self.bad_frames)
