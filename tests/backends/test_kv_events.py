"""KvMirror: engine KV events (vLLM's and SGLang's shape) re-keyed by Weir's block hashes.

The payloads are vLLM 0.32's as its ZmqEventPublisher sent them from a real engine on this
machine (tests/vllm record the same live); the replay test runs vLLM's own publisher."""

from __future__ import annotations

import importlib.util
import tempfile
import time

import msgspec
import pytest

from backends.kv_events import KvMirror, decode_batch, event_fields
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import AllCleared, BlockRemoved, BlockStored

BS = 4
TOKENS = list(range(100, 112))  # three blocks of 4


def stored(
    hashes: list[object], tokens: list[int], parent: object = None, **extra: object
) -> dict[str, object]:
    """A BlockStored as vLLM 0.32 encodes it (a map; its extra fields included)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        **extra,
    }


def test_a_recorded_vllm_frame_decodes_to_field_maps() -> None:
    # [ts, [events], dp_rank], as vLLM 0.32 published it for a 50-token prompt, block size 32.
    payload = msgspec.msgpack.encode(
        [1796168094.84, [stored([702757842669265042], list(range(100, 132)), block_size=32)], 0]
    )
    [event] = decode_batch(payload)
    assert event["type"] == "BlockStored" and event["block_hashes"] == [702757842669265042]
    with pytest.raises(ValueError):
        decode_batch(b"\xc1")
    with pytest.raises(ValueError):
        decode_batch(msgspec.msgpack.encode({"events": []}))


def test_array_encoded_events_map_to_the_same_fields() -> None:
    # SGLang (and vLLM before 0.11) encode events as tagged arrays.
    array = ["BlockStored", [7, 8], None, TOKENS[:8], BS, None, None]
    fields = event_fields(array)
    assert fields is not None
    assert (fields["type"], fields["block_hashes"], fields["token_ids"], fields["block_size"]) == (
        "BlockStored",
        [7, 8],
        TOKENS[:8],
        BS,
    )
    assert event_fields(["BlockRemoved", [7], None]) == {
        "type": "BlockRemoved",
        "block_hashes": [7],
        "medium": None,
    }
    assert event_fields(42) is None and event_fields({"no": "type"}) is None


def test_stored_blocks_get_weirs_hashes_and_chain_to_their_parent() -> None:
    mirror = KvMirror(BS)
    weir = block_hashes(TOKENS, BS)
    mirror.apply([stored([b"h1", b"h2"], TOKENS[:8])])
    mirror.apply([stored([b"h3"], TOKENS[8:], parent=b"h2")])
    first, second = mirror.take_events()
    assert (first.event_id, second.event_id) == (1, 2)
    assert first.events == [BlockStored(blocks=weir[:2], parent_seq_hash=None, tier="device")]
    assert second.events == [BlockStored(blocks=weir[2:], parent_seq_hash=weir[1], tier="device")]
    assert sorted(mirror.snapshot().blocks["device"]) == sorted(weir)
    assert mirror.snapshot().event_id == 2


def test_a_cache_salt_seeds_the_chain_as_weirs_salted_hash_does() -> None:
    mirror = KvMirror(BS)
    mirror.apply([stored([1, 2], TOKENS[:8], extra_keys=[("tenant-a",), None])])
    [batch] = mirror.take_events()
    assert batch.events[0].blocks == block_hashes(TOKENS[:8], BS, salt="tenant-a")  # type: ignore[union-attr]
    assert batch.events[0].blocks != block_hashes(TOKENS[:8], BS)  # type: ignore[union-attr]


def test_a_reannounced_prefix_sends_only_the_new_blocks() -> None:
    mirror = KvMirror(BS)
    weir = block_hashes(TOKENS, BS)
    mirror.apply([stored([1, 2], TOKENS[:8])])
    mirror.take_events()
    mirror.apply([stored([1, 2], TOKENS[:8])])  # vLLM reports prefix hits as stores
    assert mirror.take_events() == []
    mirror.apply([stored([1, 2, 3], TOKENS)])
    [batch] = mirror.take_events()
    assert batch.events == [BlockStored(blocks=weir[2:], parent_seq_hash=weir[1], tier="device")]


def test_removed_and_cleared_name_weirs_hashes() -> None:
    mirror = KvMirror(BS)
    weir = block_hashes(TOKENS, BS)
    mirror.apply([stored([1, 2, 3], TOKENS)])
    mirror.apply([{"type": "BlockRemoved", "block_hashes": [3, 99], "medium": "GPU"}])
    mirror.apply([{"type": "BlockRemoved", "block_hashes": [99], "medium": "GPU"}])  # unknown: nothing
    mirror.apply([{"type": "AllBlocksCleared"}])
    batches = mirror.take_events()
    assert [b.events for b in batches[1:]] == [
        [BlockRemoved(seq_hashes=[weir[2]], tier="device")],
        [AllCleared()],
    ]
    assert mirror.snapshot().blocks == {} and len(mirror) == 0


def test_media_map_to_tiers() -> None:
    mirror = KvMirror(BS)
    mirror.apply([stored([1], TOKENS[:4], medium="CPU"), stored([1], TOKENS[:4], medium="GPU")])
    assert sorted(mirror.snapshot().blocks) == ["device", "host"]
    mirror.apply([{"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}])
    assert sorted(mirror.snapshot().blocks) == ["device"]


@pytest.mark.parametrize(
    "event",
    [
        stored([1], TOKENS[:3], block_size=3),  # a partial block
        stored([1], TOKENS[:4], group_idx=1),  # another KV cache group (hybrid models)
        stored([1], TOKENS[:4], lora_name="sql", lora_id=1),
        stored([1], TOKENS[:4], extra_keys=[(("img-1", 0),)]),  # multimodal
        stored([1], TOKENS[:4], parent=12345),  # a parent never seen
        stored([1, 2], TOKENS[:4]),  # tokens for one block, hashes for two
    ],
    ids=["partial", "group", "lora", "multimodal", "unknown-parent", "short"],
)
def test_what_weirs_hash_cannot_name_is_left_out(event: dict[str, object]) -> None:
    mirror = KvMirror(BS)
    mirror.apply([event])
    assert mirror.take_events() == [] and len(mirror) == 0
    assert mirror.untranslated_blocks == len(event["block_hashes"])  # type: ignore[arg-type]


def test_lost_events_reset_the_mirror_and_tell_the_router() -> None:
    mirror = KvMirror(BS)
    mirror.apply([stored([1], TOKENS[:4])])
    mirror.lost_events()
    assert mirror.take_events()[-1].events == [AllCleared()] and len(mirror) == 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (its publisher)")
def test_a_gap_is_filled_from_vllms_replay_socket() -> None:
    from vllm.distributed.kv_events import BlockStored as VllmStored
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    from backends.kv_events import ZmqKvEvents

    root = tempfile.mkdtemp(prefix="weir-kv-test-")
    endpoint, replay = f"ipc://{root}/kv", f"ipc://{root}/replay"
    publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    tokens = list(range(200, 200 + 3 * BS))

    def batch(i: int) -> KVEventBatch:
        parent = None if i == 0 else i
        event = VllmStored(
            block_hashes=[i + 1],
            parent_block_hash=parent,
            token_ids=tokens[i * BS : (i + 1) * BS],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        return KVEventBatch(ts=time.time(), events=[event])

    try:
        # Two batches go out before anyone subscribes: PUB drops them.
        publisher.publish(batch(0))
        publisher.publish(batch(1))
        deadline = time.monotonic() + 10
        while publisher._event_queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        events = ZmqKvEvents(endpoint, replay, KvMirror(BS))
        mirror = events.mirror
        # The third arrives live, with seq 2: the subscriber asks the replay socket for 0 and 1.
        while len(mirror) < 3 and time.monotonic() < deadline:
            publisher.publish(batch(2))
            events.poll()
            time.sleep(0.05)
        assert sorted(mirror.snapshot().blocks["device"]) == sorted(block_hashes(tokens, BS))
        assert all(not isinstance(e, AllCleared) for b in mirror.take_events() for e in b.events)
        events.close()
    finally:
        publisher.shutdown()
