"""MockerCore: virtual-time steps over the real DeepInfer scheduler and block manager."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.mocker.config import MockerConfig
from backends.mocker.core import MockerCore, RequestOutput
from backends.mocker.timing import TimingModel
from orchestrator.runtime.protocol import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    SamplingOptions,
    WorkerRequest,
)


def request(
    rid: str,
    prompt: int | list[int] = 100,
    max_tokens: int = 8,
    seed: int | None = None,
    ignore_eos: bool = True,  # most tests here want exact lengths; the EOS tests pass False
    **kw: object,
) -> WorkerRequest:
    tokens = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else prompt
    return WorkerRequest(
        request_id=rid,
        token_ids=tokens,
        max_tokens=max_tokens,
        sampling=SamplingOptions(seed=seed),
        ignore_eos=ignore_eos,
        **kw,  # type: ignore[arg-type]
    )


def drain(core: MockerCore) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while core.has_work():
        for out in core.step().outputs:
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_step_durations_follow_the_timing_model() -> None:
    core = MockerCore(MockerConfig())
    core.add(request("a", prompt=1000, max_tokens=3))
    first = core.step()
    assert first.duration_ms == pytest.approx(core.timing.prefill(1000))
    usage = 16 / 16_384  # 1001 tokens' KV in 64-token blocks
    second = core.step()
    assert second.duration_ms == pytest.approx(core.timing.decode(usage))
    core.add(request("b", prompt=list(range(200)), max_tokens=2))
    mixed = core.step()
    assert mixed.duration_ms == pytest.approx(core.timing.prefill(200) + core.timing.decode(20 / 16_384))
    assert core.clock_ms == pytest.approx(first.duration_ms + second.duration_ms + mixed.duration_ms)


def test_outputs_carry_tokens_finish_reason_and_usage() -> None:
    core = MockerCore(MockerConfig(vocab_size=500))
    core.add(request("a", prompt=100, max_tokens=5))
    outs = drain(core)["a"]
    assert [len(o.token_ids) for o in outs] == [1] * 5
    assert all(o.finish_reason is None and o.usage is None for o in outs[:-1])
    last = outs[-1]
    assert last.finish_reason == "length"
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (100, 5, 0)
    assert all(0 <= t < 500 for t in tokens_of(outs))


def test_tokens_are_deterministic_for_a_seed_whatever_else_runs() -> None:
    alone = MockerCore(MockerConfig())
    alone.add(request("x", seed=7, max_tokens=20))
    busy = MockerCore(MockerConfig(max_num_batched_tokens=256))
    for i in range(10):
        busy.add(request(f"other{i}", prompt=300, max_tokens=30))
    busy.add(request("y", seed=7, max_tokens=20))  # another id, the same seed
    other_seed = MockerCore(MockerConfig())
    other_seed.add(request("x", seed=8, max_tokens=20))
    a, b, c = tokens_of(drain(alone)["x"]), tokens_of(drain(busy)["y"]), tokens_of(drain(other_seed)["x"])
    assert a == b
    assert a != c
    assert len(set(a)) > 15  # not a constant stream


def test_without_a_seed_the_request_id_decides() -> None:
    def run(rid: str) -> list[int]:
        core = MockerCore(MockerConfig())
        core.add(request(rid, max_tokens=10))
        return tokens_of(drain(core)[rid])

    assert run("same") == run("same")
    assert run("same") != run("different")


def test_stop_token_ids_end_the_request() -> None:
    core = MockerCore(MockerConfig())
    core.add(request("probe", seed=3, max_tokens=10))
    expected = tokens_of(drain(core)["probe"])
    stop_at = expected[4]
    core.add(request("r", seed=3, max_tokens=10, stop_token_ids=[stop_at]))
    outs = drain(core)["r"]
    assert tokens_of(outs) == expected[: expected.index(stop_at) + 1]
    assert outs[-1].finish_reason == "stop"


def test_a_repeated_prompt_reports_cached_tokens_and_prefills_less() -> None:
    core = MockerCore(MockerConfig())
    prompt = list(range(5000, 5000 + 1000))
    core.add(request("first", prompt=prompt, max_tokens=2))
    cold = core.step().duration_ms
    drain(core)
    core.add(request("second", prompt=prompt, max_tokens=2))
    warm = core.step().duration_ms
    outs = drain(core)["second"]
    usage = outs[-1].usage
    assert usage is not None and usage.cached_tokens == 960  # 15 full blocks of 64
    assert warm == pytest.approx(core.timing.prefill(40)) and warm < cold


def test_preemption_under_a_tiny_budget_still_completes_identically() -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        core = MockerCore(MockerConfig(num_blocks=num_blocks, block_size=16))
        for i in range(8):
            core.add(request(f"r{i}", prompt=list(range(i * 1000, i * 1000 + 60)), max_tokens=40))
        preempted = 0
        outputs: dict[str, list[int]] = {}
        while core.has_work():
            outs = core.step().outputs
            preempted = max(preempted, core.scheduler.num_waiting)
            for o in outs:
                outputs.setdefault(o.request_id, []).extend(o.token_ids)
        assert core.kv_cache.num_active_blocks == 0
        return outputs, preempted

    roomy, _ = run(num_blocks=1024)
    tight, waiting = run(num_blocks=12)  # one request needs 7 blocks at its longest
    assert tight == roomy and waiting > 0
    assert all(len(t) == 40 for t in tight.values())


def test_abort_frees_blocks_and_returns_the_final_output() -> None:
    core = MockerCore(MockerConfig())
    core.add(request("a", prompt=640, max_tokens=50))
    core.step()
    core.step()
    assert core.kv_cache.num_active_blocks == 11
    final = core.abort("a")
    assert final is not None and final.finish_reason == "abort"
    assert final.usage is not None and final.usage.completion_tokens == 2
    assert core.kv_cache.num_active_blocks == 0 and not core.has_work()
    assert core.abort("a") is None


def test_invalid_requests_raise_value_error() -> None:
    core = MockerCore(MockerConfig(num_blocks=4, block_size=16))
    with pytest.raises(ValueError, match="KV cache holds 64"):
        core.add(request("big", prompt=60, max_tokens=10))


def test_kv_events_reproduce_the_snapshot() -> None:
    core = MockerCore(MockerConfig(num_blocks=40, block_size=16))
    index: set[int] = set()
    last_id = 0
    evictions = 0
    for i in range(30):
        core.add(request(f"r{i}", prompt=list(range(i % 4 * 100, i % 4 * 100 + 50 + i)), max_tokens=20))
        for _ in range(3):
            core.step()
        for batch in core.take_kv_events():
            assert batch.event_id == last_id + 1
            last_id = batch.event_id
            for event in batch.events:
                if isinstance(event, BlockStored):
                    index.update(event.blocks)
                elif isinstance(event, BlockRemoved):
                    assert set(event.seq_hashes) <= index
                    evictions += len(event.seq_hashes)
                    index.difference_update(event.seq_hashes)
                elif isinstance(event, AllCleared):
                    index.clear()
    drain(core)
    snapshot = core.kv_snapshot()
    for batch in core.take_kv_events():
        for event in batch.events:
            if isinstance(event, BlockStored):
                index.update(event.blocks)
            elif isinstance(event, BlockRemoved):
                index.difference_update(event.seq_hashes)
    assert index == set(snapshot.blocks["device"])
    assert evictions > 0 and len(index) <= 40  # the small pool did evict


def test_load_report_counts() -> None:
    core = MockerCore(MockerConfig(max_num_seqs=2))
    for i in range(3):
        core.add(request(f"r{i}", prompt=100))
    core.step()
    load = core.load()
    assert (load.active_requests, load.waiting_requests, load.total_blocks) == (2, 1, 16_384)
    assert load.active_blocks == 4 and load.queued_prefill_tokens == 100


def test_output_lengths_follow_the_configured_distribution() -> None:
    # 20,000 fixed seeds: the figures are the same on every run, the tolerance is for the draw.
    seeds = range(20_000)
    core = MockerCore(MockerConfig())
    lognormal = [core.output_length(s) for s in seeds]
    assert statistics.fmean(lognormal) == pytest.approx(200, rel=0.03)
    assert statistics.median(lognormal) == pytest.approx(200 * math.exp(-(0.7**2) / 2), rel=0.05)
    assert min(lognormal) >= 1
    core = MockerCore(MockerConfig(output_length_mean=50, output_length_distribution="geometric"))
    geometric = [core.output_length(s) for s in seeds]
    assert statistics.fmean(geometric) == pytest.approx(50, rel=0.03)
    # Memoryless: P(L = 1) = 1 / mean.
    assert sum(n == 1 for n in geometric) / len(geometric) == pytest.approx(0.02, abs=0.005)
    fixed = MockerCore(MockerConfig(output_length_mean=30, output_length_distribution="fixed"))
    assert {fixed.output_length(s) for s in range(100)} == {30}


def test_a_request_ends_with_eos_at_its_drawn_length() -> None:
    core = MockerCore(MockerConfig(vocab_size=50, eos_token_ids=[7, 9]))
    for seed in range(20):
        core.add(request(f"r{seed}", max_tokens=10_000, seed=seed, ignore_eos=False))
    outputs = drain(core)
    for seed in range(20):
        outs = outputs[f"r{seed}"]
        tokens = tokens_of(outs)
        assert len(tokens) == core.output_length(seed)
        # EOS (the first id) ends it; random tokens never hit an EOS id before that.
        assert tokens[-1] == 7 and not {7, 9} & set(tokens[:-1])
        assert outs[-1].finish_reason == "stop"
        assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == len(tokens)


def seed_drawing(core: MockerCore, accept: Callable[[int], bool]) -> int:
    return next(s for s in range(10_000) if accept(core.output_length(s)))


def test_max_tokens_and_min_tokens_bound_the_drawn_length() -> None:
    core = MockerCore(MockerConfig())
    long_seed = seed_drawing(core, lambda n: n > 50)
    core.add(request("cut", max_tokens=50, seed=long_seed, ignore_eos=False))
    outs = drain(core)["cut"]
    assert len(tokens_of(outs)) == 50 and outs[-1].finish_reason == "length"
    short_seed = seed_drawing(core, lambda n: n < 20)
    core.add(request("held", max_tokens=100, seed=short_seed, ignore_eos=False, min_tokens=40))
    outs = drain(core)["held"]
    assert len(tokens_of(outs)) == 40 and outs[-1].finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens() -> None:
    core = MockerCore(MockerConfig())
    short_seed = seed_drawing(core, lambda n: n < 20)
    core.add(request("exact", max_tokens=100, seed=short_seed, ignore_eos=True))
    outs = drain(core)["exact"]
    tokens = tokens_of(outs)
    assert len(tokens) == 100 and outs[-1].finish_reason == "length" and 0 not in tokens


def test_the_length_depends_on_the_seed_only() -> None:
    seed = 12345
    alone = MockerCore(MockerConfig())
    alone.add(request("a", seed=seed, max_tokens=10_000, ignore_eos=False))
    busy = MockerCore(MockerConfig(max_num_batched_tokens=256))
    for i in range(10):
        busy.add(request(f"other{i}", prompt=300, max_tokens=30, ignore_eos=False))
    busy.add(request("b", seed=seed, max_tokens=10_000, ignore_eos=False))
    assert tokens_of(drain(alone)["a"]) == tokens_of(drain(busy)["b"])


@pytest.mark.parametrize(
    ("seed", "ignore_eos", "min_tokens"), [(7, True, 0), (None, True, 0), (11, False, 0), (13, False, 30)]
)
def test_a_migrated_request_continues_exactly(seed: int | None, ignore_eos: bool, min_tokens: int) -> None:
    config = MockerConfig(output_length_mean=20)  # EOS after ~20 tokens when it is not ignored
    whole_out = drain_one(MockerCore(config), request("m", 70, 60, seed, ignore_eos, min_tokens=min_tokens))
    whole = tokens_of(whole_out)
    cut = min(9, len(whole) - 1)
    resumed_out = drain_one(
        MockerCore(config),
        request("m", 70, 60, seed, ignore_eos, min_tokens=min_tokens, generated_token_ids=whole[:cut]),
    )
    assert whole[:cut] + tokens_of(resumed_out) == whole
    assert resumed_out[-1].finish_reason == whole_out[-1].finish_reason
    assert resumed_out[-1].usage == whole_out[-1].usage  # completion_tokens counts the earlier ones


def drain_one(core: MockerCore, req: WorkerRequest) -> list[RequestOutput]:
    core.add(req)
    return drain(core)[req.request_id]


def test_a_host_tier_hit_loads_behind_the_step() -> None:
    """A prefix evicted from the device comes back from the host tier, its copy pipelined
    with the step's layers: the step costs the pipelined time, less than compute + copy."""
    config = MockerConfig(num_blocks=40, host_cache_blocks=1000)
    core = MockerCore(config)
    prompt = list(range(20 * 64))
    core.add(request("a", prompt=prompt, max_tokens=1))
    drain(core)
    core.add(request("evict", prompt=list(range(5000, 5000 + 40 * 64 - 8)), max_tokens=8))
    drain(core)
    core.add(request("again", prompt=[*prompt, *range(9000, 9064)], max_tokens=1))
    step = core.step()
    [out] = step.outputs
    assert out.usage is not None and out.usage.cached_tokens == 20 * 64
    compute = core.timing.prefill(64)
    load = 20 * config.kv_bytes_per_token * 64 / (config.host_bandwidth_gbps * 1e6)
    assert step.duration_ms == pytest.approx(TimingModel.with_loads(compute, load, config.num_layers))
    assert step.duration_ms < compute + load


Drive = tuple[dict[str, list[int]], dict[str, str], list[object], float]


def _drive(core: MockerCore, stretches: bool) -> Drive:
    """Step `core` until idle, taking decode stretches at once if `stretches`: each request's
    tokens and finish reason, the KV events with the simulated time they came at, and the
    simulated time at the end."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    events: list[object] = []
    while core.has_work():
        steps, step_ms = core.decode_stretch() if stretches else (0, 0.0)
        result = core.advance(steps, step_ms) if steps else core.step()
        for out in result.outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
        events += [(core.clock_ms, b.event_id, b.events) for b in core.take_kv_events()]
    return tokens, finished, events, core.clock_ms


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 40), st.booleans(), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([2, 4, 8]),
    st.sampled_from([0, 16]),
)
def test_decode_stretches_give_what_single_steps_give(
    specs: list[tuple[int, int, bool, bool]], block_size: int, host_cache_blocks: int
) -> None:
    # Small blocks cross boundaries often; drawn EOS lengths, length limits, stop ids and a
    # host tier's write-through all fall inside or at the edge of stretches.
    def core() -> MockerCore:
        config = MockerConfig(
            block_size=block_size,
            num_blocks=256,
            output_length_mean=12,
            host_cache_blocks=host_cache_blocks,
            kv_bytes_per_token=16,
        )
        c = MockerCore(config)
        for i, (prompt, max_tokens, ignore_eos, stop) in enumerate(specs):
            stops = [5] if stop else []
            c.add(request(f"r{i}", prompt, max_tokens, seed=i, ignore_eos=ignore_eos, stop_token_ids=stops))
        return c

    assert _drive(core(), stretches=True) == _drive(core(), stretches=False)


def test_a_decode_stretch_ends_before_a_block_fills_or_is_allocated_a_request_ends_or_one_waits() -> None:
    core = MockerCore(MockerConfig(block_size=8, num_blocks=64))
    core.add(request("a", prompt=5, max_tokens=20))
    assert core.decode_stretch() == (0, 0.0)  # a prefill comes first
    core.step()  # 5 tokens computed, the first generated
    step_ms = core.timing.step_ms(0, True, core.kv_cache.usage)
    assert core.decode_stretch() == (2, step_ms)  # the third decode would fill block 0
    core.advance(2, step_ms)
    assert core.decode_stretch() == (0, 0.0)
    core.step()  # fills block 0
    assert core.decode_stretch() == (0, 0.0)  # the next step allocates block 1
    core.step()
    assert core.decode_stretch() == (6, core.timing.step_ms(0, True, core.kv_cache.usage))
    core.add(request("b", prompt=3, max_tokens=3))
    assert core.decode_stretch() == (0, 0.0)  # b waits to be admitted
    core.step()
    assert core.decode_stretch() == (0, 0.0)  # b ends after two more tokens: one step alike
