"""TensorRT-LLM as a Weir worker: its LLM API (`tensorrt_llm.LLM`) in the worker process.

The worker host serves token-id requests on Weir's request plane; the adapter hands them to
`LLM.generate_async` with token ids, streams its outputs back as deltas, turns TensorRT-LLM's
KV cache events (Python dicts from `LLM.get_kv_cache_events_async`, not ZMQ) into Weir's,
re-keyed by Weir's block hashes (`backends.kv_events.KvMirror`), and reports load from its
iteration stats. `args.py` holds the flags and spec (no TensorRT-LLM import), `params.py`
the pure translation, `engine.py` the `Engine`.
"""
