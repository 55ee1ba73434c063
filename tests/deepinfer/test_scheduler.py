"""Scheduler: chunked prefill under a budget, preemption, abort, stop conditions, priorities."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.deepinfer.config import EngineConfig
from backends.deepinfer.outputs import SampledToken, SchedulerOutput
from backends.deepinfer.scheduler import Scheduler
from backends.deepinfer.sequence import Sequence, SequenceStatus
from orchestrator.runtime.protocol import WorkerRequest

BS = 4
EOS = 2


def scheduler(num_blocks: int = 64, budget: int = 64, max_seqs: int = 16, **kw: object) -> Scheduler:
    cfg = EngineConfig(block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_seqs, **kw)  # type: ignore[arg-type]
    return Scheduler(cfg, num_blocks, eos_token_ids=[EOS])


def request(rid: str, prompt: int | list[int] = 8, max_tokens: int = 4, **kw: object) -> WorkerRequest:
    tokens = list(range(10, 10 + prompt)) if isinstance(prompt, int) else prompt
    return WorkerRequest(request_id=rid, token_ids=tokens, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def fake_token(seq: Sequence) -> int:
    """A deterministic 'model': the next token depends on the request and the position only."""
    return 100 + (sum(map(ord, seq.request_id)) * 31 + len(seq)) % 50


def step(s: Scheduler, token_for: Callable[[Sequence], int] = fake_token) -> SchedulerOutput:
    out = s.schedule()
    s.postprocess(out, [SampledToken(token_for(c.seq)) for c in out.chunks if c.sample])
    return out


def run(s: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while s.has_unfinished():
        outs.append(step(s))
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


def test_chunked_prefill_respects_the_budget_and_samples_once() -> None:
    s = scheduler(budget=32)
    seq = s.add(request("long", prompt=100, max_tokens=2))
    outs = [step(s) for _ in range(4)]
    assert [(c.start, c.num_tokens, c.sample) for o in outs for c in o.chunks] == [
        (0, 32, False),
        (32, 32, False),
        (64, 32, False),
        (96, 4, True),
    ]
    assert seq.num_completion_tokens == 1


def test_decodes_and_prefill_chunks_share_one_budget() -> None:
    s = scheduler(budget=16)
    s.add(request("a", prompt=8, max_tokens=10))
    step(s)
    s.add(request("b", prompt=40, max_tokens=2))
    out = step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 15)]
    assert out.num_batched_tokens == 16


def test_chunked_prefill_off_waits_for_room_for_the_whole_prompt() -> None:
    s = scheduler(budget=16, enable_chunked_prefill=False)
    s.add(request("a", prompt=8, max_tokens=4))
    s.add(request("b", prompt=12, max_tokens=4))
    out = s.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["a"]
    with pytest.raises(ValueError, match="step budget"):
        s.add(request("c", prompt=20, max_tokens=1))


def test_max_num_seqs_caps_the_running_batch() -> None:
    s = scheduler(max_seqs=2)
    for i in range(3):
        s.add(request(f"r{i}"))
    out = s.schedule()
    assert len(out.chunks) == 2 and s.num_running == 2 and s.num_waiting == 1


def test_a_repeated_prompt_is_served_from_the_prefix_cache() -> None:
    s = scheduler()
    first = s.add(request("a", prompt=20, max_tokens=3))
    run(s)
    second = s.add(request("b", prompt=20, max_tokens=3))
    out = s.schedule()
    assert out.chunks[0].start == 16 and out.chunks[0].num_tokens == 4
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 16


def test_preemption_under_a_tiny_block_budget_still_completes_identically() -> None:
    def outputs(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        s = scheduler(num_blocks=num_blocks, budget=32)
        seqs = [s.add(request(f"r{i}", prompt=list(range(i, i + 10)), max_tokens=12)) for i in range(6)]
        outs = run(s)
        preempted = sum(len(o.preempted) for o in outs)
        assert s.kv_cache.num_active_blocks == 0
        return {q.request_id: q.token_ids for q in seqs}, preempted

    roomy, none = outputs(num_blocks=64)
    tight, some = outputs(num_blocks=8)  # one sequence needs 6 blocks at its longest
    assert none == 0 and some > 0
    assert tight == roomy
    assert all(len(t) == 22 for t in tight.values())


def test_abort_frees_blocks_at_once_wherever_the_request_is() -> None:
    s = scheduler(max_seqs=1)
    running = s.add(request("run", prompt=12))
    waiting = s.add(request("wait", prompt=12))
    step(s)
    assert s.kv_cache.num_active_blocks == 3  # the 13th token's slot comes next step
    assert s.abort("run") is running and running.finish_reason == "abort"
    assert s.kv_cache.num_active_blocks == 0 and s.num_running == 0
    assert s.abort("wait") is waiting and s.num_waiting == 0
    assert s.abort("wait") is None
    assert not s.has_unfinished()


def test_abort_while_a_step_runs_drops_its_results() -> None:
    s = scheduler()
    s.add(request("a"))
    keep = s.add(request("b"))
    out = s.schedule()
    s.abort("a")
    results = s.postprocess(out, [SampledToken(7), SampledToken(8)])
    assert [r.seq for r in results] == [keep] and keep.token_ids[-1] == 8


@pytest.mark.parametrize(
    ("kw", "tokens", "expected_len", "reason"),
    [
        ({"max_tokens": 3}, [5, 6, 7, 8], 3, "length"),
        ({"max_tokens": 9, "stop_token_ids": [6]}, [5, 6, 7], 2, "stop"),
        ({"max_tokens": 9}, [5, EOS, 7], 2, "stop"),
        ({"max_tokens": 4, "ignore_eos": True}, [EOS, EOS, EOS, EOS], 4, "length"),
        ({"max_tokens": 9, "min_tokens": 3}, [EOS, 6, EOS, 8], 3, "stop"),
        ({"max_tokens": 9, "min_tokens": 2, "stop_token_ids": [6]}, [6, 6, 7], 2, "stop"),
    ],
)
def test_stop_conditions(kw: dict[str, Any], tokens: list[int], expected_len: int, reason: str) -> None:
    s = scheduler()
    seq = s.add(request("r", **kw))
    feed = iter(tokens)
    while s.has_unfinished():
        step(s, lambda _seq: next(feed))
    assert seq.token_ids[seq.num_prompt_tokens :] == tokens[:expected_len]
    assert seq.finish_reason == reason


def test_max_model_len_ends_with_length() -> None:
    s = scheduler(max_model_len=10)
    seq = s.add(request("r", prompt=8, max_tokens=50))
    run(s)
    assert len(seq) == 10 and seq.finish_reason == "length"


def test_lower_priority_value_runs_first_and_is_preempted_last() -> None:
    s = scheduler(max_seqs=1)
    s.add(request("late", priority=5))
    s.add(request("urgent", priority=-1))
    assert [c.seq.request_id for c in s.schedule().chunks] == ["urgent"]

    s = scheduler(num_blocks=6, budget=64)
    low = s.add(request("low", prompt=8, max_tokens=12, priority=1))
    high = s.add(request("high", prompt=8, max_tokens=12, priority=0))
    step(s)
    preempted = [q for o in run(s) for q in o.preempted]
    assert preempted and all(q is low for q in preempted)
    assert high.num_completion_tokens == 12 and low.num_completion_tokens == 12


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"prompt": []}, "empty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"prompt": 200, "max_tokens": 100}, "KV cache holds"),
    ],
)
def test_requests_that_can_never_run_are_refused(kw: dict[str, object], match: str) -> None:
    s = scheduler()
    with pytest.raises(ValueError, match=match):
        s.add(request("r", **kw))  # type: ignore[arg-type]


def test_duplicate_request_ids_are_refused() -> None:
    s = scheduler()
    s.add(request("r"))
    with pytest.raises(ValueError, match="already in use"):
        s.add(request("r"))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 30),  # prompt length
            st.integers(1, 10),  # max_tokens
            st.integers(0, 2),  # priority
            st.integers(0, 12),  # abort after this many steps (0: never)
        ),
        min_size=1,
        max_size=12,
    ),
    st.integers(8, 40),
    st.integers(4, 48),
)
def test_any_workload_finishes_within_limits(
    reqs: list[tuple[int, int, int, int]], num_blocks: int, budget: int
) -> None:
    s = scheduler(num_blocks=num_blocks, budget=budget, max_seqs=4)
    seqs: list[Sequence] = []
    aborts: dict[int, list[str]] = {}
    for i, (prompt, max_tokens, prio, abort_at) in enumerate(reqs):
        if -(-(prompt + max_tokens) // BS) > num_blocks:
            continue
        seqs.append(s.add(request(f"r{i}", prompt=list(range(prompt)), max_tokens=max_tokens, priority=prio)))
        if abort_at:
            aborts.setdefault(abort_at, []).append(f"r{i}")
    steps = 0
    while s.has_unfinished():
        out = step(s)
        steps += 1
        for rid in aborts.get(steps, []):
            s.abort(rid)
        assert out.num_batched_tokens <= budget
        assert len({id(c.seq) for c in out.chunks}) == len(out.chunks) <= 4
        queued = sum(len(e[2]) for e in s.waiting)
        queued += sum(max(0, q.num_prompt_tokens - q.num_computed_tokens) for q in s.running)
        assert s.queued_prefill_tokens() == queued
        held = {b for q in s.running for b in q.block_table}  # shared prefix blocks count once
        assert s.kv_cache.num_active_blocks == len(held)
        assert steps < 10_000
    for q in seqs:
        if q.finish_reason == "abort":
            assert q.num_completion_tokens <= q.request.max_tokens
        else:
            assert q.finish_reason == "length" and q.num_completion_tokens == q.request.max_tokens
    assert s.kv_cache.num_active_blocks == 0


def test_a_request_whose_kv_is_arriving_waits_at_its_place_until_it_arrives() -> None:
    """Disaggregation's decode side: the sequence is queued (and counted) while its prompt KV
    travels, nothing of it runs, and once it arrives it goes before requests that came later."""
    s = scheduler(budget=8, max_seqs=1)
    a = s.add(request("a", prompt=8, max_tokens=1), arriving=True)
    s.add(request("b", prompt=8, max_tokens=1))
    s.add(request("c", prompt=8, max_tokens=1))
    assert s.num_waiting == 3 and s.queued_prefill_tokens() == 24
    assert [c.seq.request_id for c in step(s).chunks] == ["b"]
    assert a.status is SequenceStatus.LOADING_KV
    s.arrive("a", {})  # nothing came through: it computes its prompt
    assert [c.seq.request_id for c in step(s).chunks] == ["a"]
    assert [c.seq.request_id for c in step(s).chunks] == ["c"]
    assert not s.has_unfinished() and s.queued_prefill_tokens() == 0


def test_a_request_aborted_while_its_kv_is_arriving_leaves_nothing() -> None:
    s = scheduler()
    s.add(request("a", prompt=8), arriving=True)
    assert s.abort("a") is not None
    s.arrive("a", {})  # the pull's end, after the abort: a no-op
    assert not s.has_unfinished() and s.num_waiting == 0 and s.queued_prefill_tokens() == 0
    assert step(s).is_empty
