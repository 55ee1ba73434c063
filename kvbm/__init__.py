"""KV block manager: the tiers of KV cache below an engine's own memory (G1).

G2 host memory (`stores.HostStore`), G3 local disk (`disk.DiskStore`), G4 a remote store
shared by every worker of a model (`redis_store.RedisStore`); `tiered.TieredStore` moves
blocks between them, keyed by the shared sequence hash, in the form `records.py` defines.
The device's own pool and prefix cache are the engine's (DeepInfer's `block_pool.py` and
`kv_cache_manager.py`), which hands blocks down and takes them back through this package.
Nothing here imports torch.
"""
