"""The TTFT-predicting policy: predicted first-token time from queued prefill, the uncached
prompt and the step model the mocker simulates with."""

from __future__ import annotations

from orchestrator.runtime.protocol import LoadReport
from router.block_index import BlockIndex
from router.cost import CostParams
from router.load import LoadTracker
from router.policies.ttft import TtftPolicy
from router.protocols import RouteRequest, WorkerLoad
from router.step_time import StepTime

BS = 64


class Index:
    """The index's two calls over a BlockIndex, without events."""

    def __init__(self) -> None:
        self.blocks = BlockIndex()

    def find_matches(self, hashes: list[int]):  # type: ignore[no-untyped-def]
        return self.blocks.find_matches(hashes)

    def on_routed(self, worker_id: str, hashes: list[int]) -> None:
        pass


def load(queued: int = 0, running: int = 0) -> WorkerLoad:
    w = WorkerLoad(queued_prefill_tokens=queued, active_requests=running, total_blocks=1000)
    w.refresh()
    return w


def test_the_prediction_is_the_step_models_prefill_of_queue_plus_uncached_prompt() -> None:
    step = StepTime()
    policy = TtftPolicy(Index(), BS, CostParams(), step, step_tokens=8192)
    # Idle: one prefill step of the prompt.
    assert policy.predicted_ttft_ms(1000, load()) == step.prefill(1000)
    # 9,000 queued tokens and 1,000 of its own: a full 8,192-token step, then the rest, each
    # beside a decode step of the running batch.
    busy = load(queued=9000, running=4)
    expected = step.prefill(8192) + step.prefill(1808) + 2 * step.decode(busy.kv_usage)
    assert policy.predicted_ttft_ms(1000, busy) == expected


def test_a_cache_hit_wins_unless_the_queue_ahead_costs_more_than_it_saves() -> None:
    index = Index()
    hashes = list(range(32))  # a 2,048-token prompt
    index.blocks.store("warm", hashes[:24])  # 1,536 tokens cached there
    policy = TtftPolicy(index, BS, CostParams(), step_tokens=8192, seed=0)
    request = RouteRequest("r", 32 * BS, hashes)
    assert policy.select(request, {"warm": load(queued=256), "cold": load()}).worker_id == "warm"
    decision = policy.select(request, {"warm": load(queued=4000), "cold": load()})
    assert decision.worker_id == "cold"
    assert decision.cost == StepTime().prefill(2048)  # the prediction rides on the decision


def test_each_worker_is_predicted_with_the_step_curve_it_reports() -> None:
    # Two idle cold workers; "slow" reports (LoadReport.step_time) a prefill twice the default.
    default = StepTime()
    slow_curve = StepTime(tuple(2 * c for c in default.prefill_ms), default.decode_ms)
    tracker = LoadTracker("r", BS)
    for worker_id in ("slow", "fast"):
        tracker.add_worker(worker_id, total_blocks=1000)
    tracker.apply_report(LoadReport(worker_id="slow", total_blocks=1000, step_time=slow_curve.curves(64)))
    tracker.apply_report(LoadReport(worker_id="fast", total_blocks=1000))  # reports none: the default
    policy = TtftPolicy(Index(), BS, CostParams(), step_tokens=8192, seed=0)
    assert policy.predicted_ttft_ms(1000, tracker.workers["slow"]) == slow_curve.prefill(1000)
    decision = policy.select(RouteRequest("r", 1000, []), tracker.workers)
    assert decision.worker_id == "fast" and decision.cost == default.prefill(1000)
