"""The cost model and selection, by worked examples."""

from __future__ import annotations

import random

import pytest

from orchestrator.runtime.protocol import BlockStored, KvEventBatch
from router.cost import CostParams, available, balanced, busy, cached_blocks, choose, costs
from router.indexer import KvIndexer
from router.policies.kv import KvPolicy
from router.protocols import RouteRequest, WorkerLoad


def test_worked_example_cache_hit_beats_idle_worker_at_weight_one() -> None:
    # 10-block prompt. A caches 6 blocks and decodes with 2 active blocks; B is idle, cold.
    params = CostParams(overlap_weight=1.0)
    a, b = costs(10, [6, 0], [2, 0], params)
    assert (a, b) == (1.0 * 4 + 2, 1.0 * 10 + 0)  # 6 vs 10
    assert choose([a, b], [2, 0], 0.0, random.Random(0)) == 0


def test_worked_example_low_weight_prefers_balance() -> None:
    params = CostParams(overlap_weight=0.1)
    a, b = costs(10, [6, 0], [2, 0], params)
    assert a == pytest.approx(0.4 + 2) and b == pytest.approx(1.0)
    assert choose([a, b], [2, 0], 0.0, random.Random(0)) == 1


def test_lower_tier_hits_are_credited_per_tier() -> None:
    params = CostParams(host_credit=0.25, remote_credit=0.1)
    # 6 cached blocks of which 2 sit in host memory and 2 in the remote store:
    # 2 on the device + 0.25 * 2 + 0.1 * 2 = 2.7 credited
    assert cached_blocks(6, {"host": 2, "remote": 2}, params) == pytest.approx(2.7)
    assert cached_blocks(6, {}, params) == 6
    assert costs(10, [2.7], [0], params) == [pytest.approx(7.3)]
    assert costs(4, [6], [1], params) == [1.0]  # more cached than asked (tail block): no negative work


def test_ties_go_to_the_least_loaded_then_to_a_seeded_random_pick() -> None:
    assert choose([5.0, 5.0, 7.0], [3, 1, 0], 0.0, random.Random(0)) == 1
    picks = {choose([5.0, 5.0, 5.0], [1, 1, 1], 0.0, random.Random(seed)) for seed in range(40)}
    assert picks == {0, 1, 2}
    first = [choose([1.0, 1.0], [0, 0], 0.0, random.Random(7)) for _ in range(5)]
    assert first == [choose([1.0, 1.0], [0, 0], 0.0, random.Random(7)) for _ in range(5)]


def test_temperature_samples_softmax_of_normalised_costs() -> None:
    # costs 0 and 10 normalise to 0 and 1: at T = 1, p = [1, e^-1] / (1 + e^-1) = [0.731, 0.269]
    rng = random.Random(1)
    n = 20_000
    zero = sum(choose([0.0, 10.0], [0, 0], 1.0, rng) == 0 for _ in range(n))
    assert zero / n == pytest.approx(0.731, abs=0.015)
    # a low temperature is nearly argmin; equal costs are uniform
    assert sum(choose([0.0, 10.0], [0, 0], 0.05, rng) == 0 for _ in range(1000)) > 990
    uniform = sum(choose([3.0, 3.0], [0, 0], 1.0, rng) for _ in range(n))
    assert uniform / n == pytest.approx(0.5, abs=0.015)


def load(blocks: int, total: int, waiting: int = 0) -> WorkerLoad:
    worker = WorkerLoad(active_blocks=blocks, total_blocks=total, waiting_requests=waiting)
    worker.refresh()
    return worker


def test_busy_thresholds() -> None:
    params = CostParams(busy_kv_fraction=0.9, busy_waiting_requests=4)
    workers = [load(90, 100), load(91, 100), load(0, 100, waiting=5), load(500, 0)]
    # the last reports no capacity: never busy by blocks
    assert busy(workers, params) == [False, True, True, False]
    assert busy([load(0, 100, waiting=99)], CostParams()) == [False]  # waiting threshold off by default


def test_invalid_params_are_rejected() -> None:
    with pytest.raises(ValueError):
        CostParams(overlap_weight=-1)
    with pytest.raises(ValueError):
        CostParams(remote_credit=2)
    with pytest.raises(ValueError):
        CostParams(balance_abs_requests=-1)
    with pytest.raises(ValueError):
        CostParams(balance_rel=0.5)


def requests(n: int) -> WorkerLoad:
    worker = WorkerLoad(inflight_requests=n, total_blocks=1000)
    worker.refresh()
    return worker


def test_the_herding_guard_leaves_out_workers_past_both_margins() -> None:
    params = CostParams(balance_abs_requests=8, balance_rel=1.5)
    # least loaded 10: the bound is max(10 * 1.5, 10 + 8) = 18
    workers = {"a": requests(10), "b": requests(18), "c": requests(19), "d": requests(40)}
    assert list(balanced(workers, params)) == ["a", "b"]
    assert list(available(workers, params)) == ["a", "b"]
    # small counts pass the ratio easily but not the absolute margin
    few = {"a": requests(0), "b": requests(8)}
    assert balanced(few, params) is few
    # at 100 the ratio is the larger margin: 150
    many = {"a": requests(100), "b": requests(150), "c": requests(151)}
    assert list(balanced(many, params)) == ["a", "b"]
    assert balanced(workers, CostParams(balance_abs_requests=0)) is workers  # off


def test_a_hot_prefix_stops_drawing_requests_once_its_worker_is_past_the_guard() -> None:
    # Worker a holds a 100-block prompt; at overlap weight 10 the hit outweighs any queue.
    index = KvIndexer()
    hashes = list(range(1, 101))
    index.apply_batch(KvEventBatch(worker_id="a", event_id=1, events=[BlockStored(blocks=hashes)]))
    request = RouteRequest("r", 100 * 16, hashes)
    workers = {"a": requests(80), "b": requests(0)}
    herding = KvPolicy(index, 16, CostParams(overlap_weight=10, balance_abs_requests=0))
    guarded = KvPolicy(index, 16, CostParams(overlap_weight=10, balance_abs_requests=64))
    assert herding.select(request, workers).worker_id == "a"
    assert guarded.select(request, workers).worker_id == "b"
    workers["a"] = requests(64)  # within the margin: the hit wins again
    assert guarded.select(request, workers).worker_id == "a"
