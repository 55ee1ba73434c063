"""KV block manager: tiers of KV cache below the engine's own memory (G1).

Planned per docs/architecture.md: G2 host memory, G3 local SSD files, G4 a remote store,
blocks keyed by the shared sequence hash. Not built yet; the G1 block pool with prefix
caching and KV events lives in `backends/deepinfer/block_manager.py` today.
"""
