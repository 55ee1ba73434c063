"""Prometheus series of the KV tiers, per tier: what moved, how often a lookup found its
block there, how long moves took, and what failed (a failure is also a miss)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

OFFLOAD_BLOCKS = Counter("weir_kvbm_offload_blocks", "Blocks written into a tier", ["tier"])
OFFLOAD_BYTES = Counter("weir_kvbm_offload_bytes", "Bytes written into a tier", ["tier"])
ONBOARD_BLOCKS = Counter("weir_kvbm_onboard_blocks", "Blocks loaded from a tier into the engine", ["tier"])
ONBOARD_BYTES = Counter("weir_kvbm_onboard_bytes", "Bytes loaded from a tier into the engine", ["tier"])
# hit rate of a tier = hits / lookups: of the blocks no faster tier held, how many it did.
LOOKUPS = Counter("weir_kvbm_lookups", "Prefix blocks looked for in a tier", ["tier"])
HITS = Counter("weir_kvbm_hits", "Prefix blocks found in a tier", ["tier"])
ERRORS = Counter("weir_kvbm_errors", "Blocks a tier failed to return intact (served as a miss)", ["tier"])
SKIPPED = Counter(
    "weir_kvbm_transfers_skipped", "Offloads to a slow tier dropped because its transfer queue was full"
)
BLOCKS = Gauge("weir_kvbm_blocks", "Blocks held in a tier by this process", ["tier"])
TRANSFER_SECONDS = Histogram(
    "weir_kvbm_transfer_seconds",
    "Time of one batch of block moves",
    ["tier", "direction"],
    buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0),
)
