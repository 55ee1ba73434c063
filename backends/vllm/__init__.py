"""vLLM as a Weir worker: its v1 async engine (`AsyncLLM`) in the worker process.

The worker host serves token-id requests on Weir's request plane; the adapter hands them to
vLLM's engine directly (not through vLLM's HTTP server), streams its deltas back, relays its
ZMQ KV events re-keyed by Weir's block hashes (`backends.kv_events`) and reports load from its
scheduler stats. `args.py` holds the flags and spec (no vLLM import), `params.py` the pure
translation of requests and outputs, `worker.py` the `Engine`.
"""
