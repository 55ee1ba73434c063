"""Multi-process KV-routing clusters for tests: what `tests/cluster.py` starts, sent requests
sharing one long prefix.

Shared by `test_kv_cluster.py` (the frontend routes by itself) and `test_service.py` (the
frontend asks a standalone `weir router`)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from backends.registry import DEFAULT_MODEL
from tests.cluster import Cluster, metric
from tests.waiting import wait_until

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
        return self._per_live_worker(self.served_by)

    def kv_events_published(self) -> float:
        """KV events the live workers have published, from their /metrics."""
        return sum(self._per_live_worker(self._kv_events_published_by).values())

    def wait_kv_events_applied(self, applied: Callable[[], float], since: tuple[float, float]) -> None:
        """Until a router has applied every KV event the live workers published since `since`
        (`(kv_events_published(), applied())` taken before), and there was one. `applied`
        reads that router's weir_router_kv_events_applied_total."""
        published_before, applied_before = since

        def caught_up() -> bool:
            published = self.kv_events_published() - published_before
            return published > 0 and applied() - applied_before >= published

        wait_until(caught_up, "the router to apply the workers' new KV events", 10)

    def _kv_events_published_by(self, worker: str) -> float:
        text = httpx.get(f"{self.workers[worker]}/metrics", timeout=5).text
        return metric(text, "weir_worker_kv_events_published_total", f'worker="{worker}"')

    def _per_live_worker(self, read: Callable[[str], float]) -> dict[str, float]:
        counts = {}
        for worker in self.workers:
            try:
                counts[worker] = read(worker)
            except httpx.TransportError:
                continue  # a killed worker
        return counts


def new_requests(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {w: after[w] - before.get(w, 0.0) for w in after if after[w] != before.get(w, 0.0)}
