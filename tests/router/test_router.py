"""Each routing mode through the `Router` facade, plus load tracking and approximate mode."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import BlockStored, KvEventBatch, KvSnapshot, LoadReport
from router.approx import ApproxIndexer
from router.cost import CostParams
from router.load import LoadTracker
from router.metrics import RouterMetrics
from router.policies.kv import KvPolicy
from router.protocols import InflightUpdate, NoWorkerAvailable, RouteRequest
from router.router import Router, make_policy, make_router

BS = 4


def req(request_id: str, tokens: list[int], pinned: str | None = None) -> RouteRequest:
    return RouteRequest(request_id, len(tokens), block_hashes(tokens, BS), pinned_worker=pinned)


def router_with(mode: str, n: int = 3, synced: bool = True, **params: object) -> Router:
    """`n` workers; in kv mode their (empty) snapshots applied, as the subscriber would."""
    router = make_router(mode, BS, seed=0, **params)  # type: ignore[arg-type]
    for i in range(n):
        router.add_worker(f"w{i}", total_blocks=100)
        if synced:
            router.apply_kv_snapshot(KvSnapshot(worker_id=f"w{i}", event_id=0, blocks={}))
    return router


def test_kv_routes_to_the_worker_caching_the_prefix() -> None:
    router = router_with("kv")
    prefix = list(range(40))
    router.apply_kv_batch(
        KvEventBatch(worker_id="w2", event_id=1, events=[BlockStored(blocks=block_hashes(prefix, BS))])
    )
    decision = router.select(req("a", [*prefix, 99, 98, 97, 96]))
    assert decision.worker_id == "w2"
    assert decision.overlap_blocks == 10 == decision.best_overlap_blocks
    assert router.workers["w2"].inflight_blocks == 11
    # without a cached prefix, the least loaded worker wins
    assert router.select(req("b", [7] * 8)).worker_id != "w2"


def test_kv_leaves_a_saturated_worker_alone() -> None:
    router = router_with("kv")
    prefix = list(range(40))
    router.apply_kv_batch(
        KvEventBatch(worker_id="w1", event_id=1, events=[BlockStored(blocks=block_hashes(prefix, BS))])
    )
    router.apply_load(LoadReport(worker_id="w1", active_blocks=99, total_blocks=100))
    assert router.select(req("a", prefix)).worker_id != "w1"


def test_kv_balances_when_hits_are_equal() -> None:
    router = router_with("kv")
    chosen = [router.select(req(f"r{i}", [i] * 8)).worker_id for i in range(6)]
    assert sorted(chosen) == ["w0", "w0", "w1", "w1", "w2", "w2"]


def test_late_events_from_an_unknown_worker_are_dropped() -> None:
    router = router_with("kv")
    router.remove_worker("w0")
    batch = KvEventBatch(worker_id="w0", event_id=1, events=[BlockStored(blocks=[1, 2])])
    assert not router.apply_kv_batch(batch)
    assert router.index is not None and router.index.find_matches([1]).blocks == {}


def test_round_robin_cycles_and_random_covers_all() -> None:
    router = router_with("round-robin")
    assert [router.select(req(str(i), [1] * 4)).worker_id for i in range(4)] == ["w0", "w1", "w2", "w0"]
    router = router_with("random")
    assert {router.select(req(str(i), [1] * 4)).worker_id for i in range(60)} == {"w0", "w1", "w2"}


def test_least_loaded_counts_own_inflight_and_reports() -> None:
    router = router_with("least-loaded")
    router.apply_load(LoadReport(worker_id="w0", active_requests=5))
    first = router.select(req("a", [1] * 4)).worker_id
    second = router.select(req("b", [1] * 4)).worker_id
    assert {first, second} == {"w1", "w2"}
    router.on_finish(first, "a")
    assert router.select(req("c", [1] * 4)).worker_id == first


def test_direct_needs_a_live_pinned_worker() -> None:
    router = router_with("direct")
    assert router.select(req("a", [1], pinned="w1")).worker_id == "w1"
    with pytest.raises(NoWorkerAvailable):
        router.select(req("b", [1]))
    with pytest.raises(NoWorkerAvailable):
        router.select(req("c", [1], pinned="nope"))


@pytest.mark.parametrize("mode", ["kv", "ttft", "round-robin", "least-loaded", "random"])
def test_excluded_workers_are_not_chosen_and_stay_known(mode: str) -> None:
    router = router_with(mode, n=3)
    picked = {router.select(req(str(i), [1, 2]), exclude=["w0", "w2"]).worker_id for i in range(6)}
    assert picked == {"w1"}
    assert not router.loads.draining and set(router.workers) == {"w0", "w1", "w2"}
    with pytest.raises(NoWorkerAvailable):
        router.select(req("x", [1]), exclude=["w0", "w1", "w2"])


def test_draining_and_empty_pools_are_not_routed_to() -> None:
    router = router_with("round-robin", n=2)
    router.set_draining("w0", True)
    assert {router.select(req(str(i), [1])).worker_id for i in range(3)} == {"w1"}
    router.set_draining("w1", True)
    with pytest.raises(NoWorkerAvailable):
        router.select(req("x", [1]))
    with pytest.raises(ValueError, match="unknown router mode"):
        make_policy("fastest")


def test_inflight_blocks_count_shared_prefixes_once() -> None:
    loads = LoadTracker("r", BS)
    loads.add_worker("w")
    shared = list(range(16))
    loads.on_routed("w", req("a", [*shared, 1, 2, 3, 4, 5]))  # 5 full blocks + 1 partial
    loads.on_routed("w", req("b", [*shared, 9, 9, 9, 9]))  # 4 shared + 1 new block
    assert loads.workers["w"].inflight_blocks == 6 + 1
    assert loads.on_finish("w", "a") is not None
    assert loads.workers["w"].inflight_blocks == 5
    loads.on_finish("w")  # the oldest remaining request: b
    assert loads.workers["w"].inflight_blocks == 0 == loads.workers["w"].inflight_requests


def test_a_reused_request_id_finishing_its_first_placement_leaves_the_second_counted() -> None:
    loads = LoadTracker("r", BS)
    for w in ("w1", "w2"):
        loads.add_worker(w)
    loads.on_routed("w1", req("a", list(range(8))))
    loads.on_routed("w2", req("a", list(range(100, 112))))  # the id again: w1's placement is released
    assert loads.on_finish("w1", "a") is None  # the first placement's late finish
    assert (loads.workers["w1"].inflight_blocks, loads.workers["w2"].inflight_blocks) == (0, 3)
    assert loads.on_finish("w2", "a") is not None
    assert loads.workers["w2"].inflight_blocks == 0 == loads.workers["w2"].inflight_requests


def test_replicas_share_inflight_load_and_expire_dead_ones() -> None:
    now = [0.0]
    loads = LoadTracker("me", BS, peer_ttl_s=10, clock=lambda: now[0])
    loads.add_worker("w")
    loads.apply_peer(InflightUpdate(router_id="other", worker_id="w", request_id="x", blocks=7))
    loads.apply_peer(InflightUpdate(router_id="me", worker_id="w", request_id="y", blocks=3))  # an echo
    assert (loads.workers["w"].inflight_requests, loads.workers["w"].inflight_blocks) == (1, 7)
    loads.apply_peer(InflightUpdate(router_id="other", worker_id="w", request_id="x", blocks=7, done=True))
    assert loads.workers["w"].inflight_blocks == 0
    loads.apply_peer(InflightUpdate(router_id="gone", worker_id="w", request_id="z", blocks=4))
    now[0] = 11.0
    loads.apply_peer(InflightUpdate(router_id="other", worker_id="w", request_id="q", blocks=1))
    assert loads.workers["w"].inflight_blocks == 1  # the dead replica's request expired


def test_router_publishes_its_inflight_changes() -> None:
    router = router_with("kv", n=1)
    sent: list[InflightUpdate] = []
    router.on_inflight = sent.append
    decision = router.select(req("a", list(range(8))))
    router.on_finish(decision.worker_id, "a")
    assert [(u.request_id, u.blocks, u.done) for u in sent] == [("a", 2, False), ("a", 2, True)]


def test_approximate_mode_learns_from_its_decisions_and_forgets_after_ttl() -> None:
    now = [0.0]
    index = ApproxIndexer(ttl_s=60, max_blocks=1000, clock=lambda: now[0])
    router = Router(KvPolicy(index, BS, CostParams(), seed=0), block_size=BS, index=index, mode="kv")
    for w in ("w0", "w1", "w2"):
        router.add_worker(w)
    prefix = list(range(40))
    first = router.select(req("a", prefix)).worker_id
    router.on_finish(first, "a")
    again = router.select(req("b", [*prefix, 5, 5, 5, 5]))
    assert again.worker_id == first and again.overlap_blocks == 10
    router.on_finish(first, "b")
    now[0] = 61.0
    assert router.select(req("c", prefix)).overlap_blocks == 0


def test_approximate_index_is_capped() -> None:
    index = ApproxIndexer(ttl_s=60, max_blocks=5)
    index.on_routed("w", [1, 2, 3, 4])
    index.on_routed("v", [7, 8, 9])
    assert len(index) == 5
    assert index.find_matches([1, 2, 3, 4]).blocks == {}  # the oldest (1, 2) went first
    assert index.find_matches([7, 8, 9]).blocks == {"v": 3}


def test_make_router_without_events_uses_the_approximate_index() -> None:
    router = make_router("kv", BS, kv_events=False, overlap_weight=2.0)
    assert isinstance(router.index, ApproxIndexer)
    assert router.select is not None and router.needs_resync() == []


def test_workers_whose_cache_is_unknown_wait_for_their_snapshot() -> None:
    router = router_with("kv", n=2, synced=False)  # a restarted router: no snapshot yet
    assert {router.select(req(str(i), [1] * 4)).worker_id for i in range(4)} == {"w0", "w1"}
    router.apply_kv_snapshot(KvSnapshot(worker_id="w0", event_id=5, blocks={"device": [1]}))
    assert {router.select(req(f"x{i}", [1] * 4)).worker_id for i in range(4)} == {"w0"}
    router.apply_kv_batch(KvEventBatch(worker_id="w1", event_id=1, events=[]))  # a fresh worker
    assert router.select(req("y", [1] * 4)).worker_id == "w1"  # routable again, and the least loaded


def test_metrics_land_in_the_given_registry() -> None:
    registry = CollectorRegistry()
    router = make_router("kv", BS, seed=0, model="m", metrics=RouterMetrics(registry))
    router.add_worker("w0")
    prefix = list(range(16))
    router.apply_kv_batch(
        KvEventBatch(worker_id="w0", event_id=1, events=[BlockStored(blocks=block_hashes(prefix, BS))])
    )
    router.select(req("a", [*prefix, 1, 2, 3, 4]))
    value = registry.get_sample_value
    assert value("weir_router_decisions_total", {"model": "m", "mode": "kv"}) == 1
    assert value("weir_router_prompt_blocks_total", {"model": "m", "mode": "kv"}) == 5
    assert value("weir_router_chosen_overlap_blocks_total", {"model": "m", "mode": "kv"}) == 4
    assert value("weir_router_kv_events_applied_total", {"model": "m"}) == 1
    assert value("weir_router_decision_seconds_count", {"model": "m", "mode": "kv"}) == 1


def test_a_prompt_repeated_before_the_events_arrive_goes_where_the_first_went() -> None:
    # Weighted above its load (1 per in-flight block), a cached prefix decides the placement.
    router = make_router("kv", 4, seed=0, metrics=RouterMetrics(CollectorRegistry()), overlap_weight=2.0)
    for worker in ("a", "b", "c", "d"):
        router.add_worker(worker)
        router.apply_kv_batch(KvEventBatch(worker_id=worker, event_id=1, events=[]))
    prompt = list(range(64))
    first = router.select(RouteRequest("r1", len(prompt), block_hashes(prompt, 4)))
    # No KV event yet says where r1's blocks are: the router still knows where it sent r1.
    again = router.select(RouteRequest("r2", len(prompt), block_hashes(prompt, 4)))
    assert again.worker_id == first.worker_id and again.overlap_blocks == 16
    router.on_finish(first.worker_id, "r1")
    router.on_finish(again.worker_id, "r2")
    # Both ended and no event ever stored the blocks: nothing is predicted any more.
    late = router.select(RouteRequest("r3", len(prompt), block_hashes(prompt, 4)))
    assert late.overlap_blocks == 0
