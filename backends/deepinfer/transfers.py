"""The engine's side of disaggregation, shared by DeepInfer and the mocker: what a prefill-only
request's held blocks are called on the wire, and which arrived records a decode may use.

Blocks travel as kvbm records (`kvbm.records`), keyed by the hash the prefill worker claims and
the engine's layout id. A decode engine uses a record only if it is the block the transfer
names, of its own layout, intact and of its block size; the first record that is not ends what
it takes, because a prefix with a hole is no prefix (the rest is computed, as a tier miss is).
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.deepinfer.kv_cache_manager import Held
from kvbm import records
from kvbm.records import Payload
from orchestrator.runtime.protocol import KvTransfer


def describe(request_id: str, held: Held | None, layout: int, block_bytes: int) -> KvTransfer | None:
    """The transfer a finished prefill-only request offers (its host fills in where from)."""
    if held is None or not held.blocks:
        return None
    return KvTransfer(
        transfer_id=request_id,
        block_hashes=[name for _, name in held.blocks],
        layout=layout,
        block_bytes=block_bytes,
    )


def to_records(blocks: list[tuple[int, int]], payloads: Sequence[Payload], layout: int) -> list[bytes]:
    """Held `(block_id, name)` blocks' payloads as records under their names."""
    return [
        records.encode(name, layout, payload) for (_, name), payload in zip(blocks, payloads, strict=True)
    ]


def arrived_blocks(
    transfer: KvTransfer, arrived_kv: Sequence[Payload], layout: int, block_bytes: int
) -> dict[int, Payload]:
    """seq_hash -> payload of the leading records a decode engine can load. Hashes and copies
    every payload: call it off the event loop for real KV."""
    arrived: dict[int, Payload] = {}
    for seq_hash, record in zip(transfer.block_hashes, arrived_kv, strict=False):
        payload = records.decode(record, seq_hash, layout)
        if payload is None or len(payload) != block_bytes:
            break
        arrived[seq_hash] = payload
    return arrived
