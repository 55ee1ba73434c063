"""Multi-process KV-routing clusters for tests: what `tests/cluster.py` starts, sent requests
sharing one long prefix.

Shared by `test_kv_cluster.py` (the frontend routes by itself) and `test_service.py` (the
frontend asks a standalone `weir router`)."""

from __future__ import annotations

import httpx

from backends.registry import DEFAULT_MODEL
from tests.cluster import Cluster

WORKERS = ("worker-a", "worker-b", "worker-c")
PREFIX = [(7 * i) % 900 + 10 for i in range(2048)]  # 32 blocks of 64 tokens


class KvCluster(Cluster):
    def complete(self, suffix: int) -> int:
        """One request on the shared prefix; the prompt tokens the worker found cached."""
        prompt = [*PREFIX, suffix, suffix + 1]
        reply = self.client.completions.create(
            model=DEFAULT_MODEL, prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None
        details = reply.usage.prompt_tokens_details
        return details.cached_tokens or 0 if details is not None else 0

    def served(self) -> dict[str, float]:
        counts = {}
        for worker in self.workers:
            try:
                counts[worker] = self.served_by(worker)
            except httpx.TransportError:
                continue  # a killed worker
        return counts


def new_requests(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {w: after[w] - before.get(w, 0.0) for w in after if after[w] != before.get(w, 0.0)}
