"""SGLang as a Weir worker: its offline `sglang.Engine` in the worker process.

The worker host serves token-id requests on Weir's request plane; the adapter hands them to
SGLang's tokenizer manager directly (`Engine.async_generate`, not SGLang's HTTP server),
streams its outputs back as deltas, relays SGLang's ZMQ KV events re-keyed by Weir's block
hashes (`backends.kv_events`) and reports load from SGLang's per-scheduler load snapshots.
`args.py` holds the flags and spec (no SGLang import), `params.py` the pure translation of
requests, outputs and KV events, `engine.py` the `Engine`.
"""
