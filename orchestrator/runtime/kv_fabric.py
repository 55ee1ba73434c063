"""The seam for a transfer engine that moves KV between hosts (kv_transfer.py has the rest of
the data plane): Mooncake's TransferEngine today (kv_mooncake.py); NIXL would be another
`KvFabric`.

A fabric pushes, as shared memory does: the decode worker (the caller of a pull) registers a
receive buffer with its fabric and names it in its `KvBlocksCall` (its fabric session, the
buffer's address and size); the prefill worker writes the records into it through its own
fabric, a batch at a time, and after each batch sends a `KvPushed` frame on the request plane
(where the records lie; no KV bytes). The caller owns the buffer, so nothing a server does can
make it leak, and a server never exposes its own memory to reads. The request plane still
carries the call, with the cluster's secret and TLS; the fabric's own port has neither, so a
fabric is for a network the operator trusts, as RDMA fabrics are.
"""

from __future__ import annotations

from typing import Literal, Protocol, get_args

FabricName = Literal["mooncake"]
FABRICS: tuple[str, ...] = get_args(FabricName)


class ReceiveBuffer(Protocol):
    """Memory a peer's fabric may write into until `close`."""

    address: int  # where it starts, in the caller's address space (what a writer targets)
    view: memoryview  # the same bytes, for reading what arrived

    def close(self, complete: bool) -> None:
        """Stop accepting writes. `complete`: every write a peer started has finished (each was
        confirmed by its frame), so the memory may go with its last view; otherwise a write may
        still be landing, and the fabric keeps the memory alive until none can be."""
        ...


class KvFabric(Protocol):
    name: str  # the transport's label in metrics
    session: str  # how a peer's fabric reaches this one: "<name>:<endpoint>"

    def receive_buffer(self, size: int) -> ReceiveBuffer: ...

    def write(self, session: str, records: list[bytes], address: int) -> None:
        """Blocking: `records`, back to back, into the peer `session`'s memory at `address`;
        OSError if they did not all land."""
        ...

    def close(self) -> None: ...


def make_fabric(name: FabricName, hostname: str) -> KvFabric:
    """This process's fabric `name`, reachable by peers at `hostname`; ValueError with what to
    install when its engine is missing, OSError when it cannot start."""
    if name == "mooncake":
        from orchestrator.runtime.kv_mooncake import MooncakeFabric

        return MooncakeFabric(hostname)
    raise ValueError(f"unknown KV fabric {name!r}; one of {', '.join(FABRICS)}")
