"""Prometheus series of the KV tiers, per engine and tier: what moved, how often a lookup
found its block there, how long moves took, and what failed (a failure is also a miss).

Every series carries `worker`, which tells apart the engines of one process (`weir serve
--workers N` runs N, and a replay runs one mocker per worker): the instance id of the worker
that serves the engine, as in the `weir_worker_*` series (`weir worker` and `weir serve`
choose it before they build the engine, and hand it to the engine's tiers), so the two join.
An engine no worker serves (a replay's mocker, a benchmark's) takes `worker_label(name)`,
`<name>-<n>`, where n counts the tier sets built in this process.
"""

from __future__ import annotations

import itertools
import threading

from prometheus_client import Counter, Gauge, Histogram

_LABELS = ["worker", "tier"]
OFFLOAD_BLOCKS = Counter("weir_kvbm_offload_blocks", "Blocks written into a tier", _LABELS)
OFFLOAD_BYTES = Counter("weir_kvbm_offload_bytes", "Bytes written into a tier", _LABELS)
ONBOARD_BLOCKS = Counter("weir_kvbm_onboard_blocks", "Blocks loaded from a tier into the engine", _LABELS)
ONBOARD_BYTES = Counter("weir_kvbm_onboard_bytes", "Bytes loaded from a tier into the engine", _LABELS)
# hit rate of a tier = hits / lookups: of the blocks no faster tier held, how many it did.
LOOKUPS = Counter("weir_kvbm_lookups", "Prefix blocks looked for in a tier", _LABELS)
HITS = Counter("weir_kvbm_hits", "Prefix blocks found in a tier", _LABELS)
ERRORS = Counter("weir_kvbm_errors", "Blocks a tier failed to return intact (served as a miss)", _LABELS)
SKIPPED = Counter(
    "weir_kvbm_transfers_skipped",
    "Offloads to a slow tier dropped because its transfer queue was full",
    ["worker"],
)
BLOCKS = Gauge(
    "weir_kvbm_blocks", "Blocks held in a tier (one that engines share counts in full for each)", _LABELS
)
TRANSFER_SECONDS = Histogram(
    "weir_kvbm_transfer_seconds",
    "Time of one batch of block moves",
    [*_LABELS, "direction"],
    buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0),
)

_built = itertools.count()
_built_lock = threading.Lock()  # DeepInfer engines build their tiers on threads of their own


def worker_label(name: str) -> str:
    """A `worker` label no other tier set of this process has: `<name>-<n>`."""
    with _built_lock:
        return f"{name}-{next(_built)}"
