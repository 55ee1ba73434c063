"""Request plane: direct TCP, length-prefixed msgpack frames, many streams per connection."""

from __future__ import annotations

from orchestrator.runtime.request_plane.client import RequestPlaneClient, ResponseStream
from orchestrator.runtime.request_plane.security import PlaneSecurity
from orchestrator.runtime.request_plane.server import (
    Handler,
    RequestPlaneServer,
    advertised_host,
    dial_address,
)
from orchestrator.runtime.request_plane.worker_client import (
    GENERATE,
    KV_BLOCKS,
    KV_SNAPSHOT,
    MODEL_FILES,
    TcpWorkerClient,
    WorkerClient,
)

__all__ = [
    "GENERATE",
    "KV_BLOCKS",
    "KV_SNAPSHOT",
    "MODEL_FILES",
    "Handler",
    "PlaneSecurity",
    "RequestPlaneClient",
    "RequestPlaneServer",
    "ResponseStream",
    "TcpWorkerClient",
    "WorkerClient",
    "advertised_host",
    "dial_address",
]
