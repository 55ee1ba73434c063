"""Trace replay: the trace reader, synthetic tokens, offline replay through `weir replay`,
and online replay against a live frontend."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from backends.mocker.config import MockerConfig
from backends.mocker.core import MockerCore, StepResult
from backends.mocker.replay import OfflineReplay, VirtualClock
from orchestrator.cli.main import main as weir
from orchestrator.runtime.hashing import block_hashes
from router.replay import RequestRecord, TraceRequest, TraceTokens, read_trace, summarize
from router.router import make_router
from tests.cli.procs import wait_banner, weir_process
from tests.frontend.live_frontend import live_frontend
from tests.frontend.tokenizer_dirs import build_chatml

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def line(ts: float, n_in: int, n_out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def test_malformed_lines_are_reported_by_number_and_skipped(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "\n".join(
            [
                line(10, 600, 5, [0, 1]),
                "{not json",
                json.dumps({"timestamp": 1, "input_length": 10}),  # no output_length / hash_ids
                line(20, 600, 5, [0]),  # 600 tokens need 2 blocks of 512
                line(30, 100, 0, [3]),  # no output
                "",
                line(5, 100, 2, [7]),  # earlier timestamp: sorted first
            ]
        )
    )
    requests, errors = read_trace(trace)
    assert [r.line for r in requests] == [7, 1]
    assert [e.split(": ")[0].rsplit(":", 1)[1] for e in errors] == ["2", "3", "4", "5"]
    assert "need 2 hash_ids, got 1" in errors[2]


def test_equal_hash_ids_give_equal_tokens_and_engine_blocks() -> None:
    tokens = TraceTokens(trace_block_size=512, vocab_size=1000)
    a = tokens.prompt(TraceRequest(1, 0, 1000, 1, (4, 5)))
    b = tokens.prompt(TraceRequest(2, 0, 700, 1, (4, 6)))
    assert len(a) == 1000 and len(b) == 700 and max(a + b) < 1000
    assert a[:512] == b[:512] and a[512:700] != b[512:700]
    ha, hb = block_hashes(a, 64), block_hashes(b, 64)
    assert ha[:8] == hb[:8] and ha[8] != hb[8]
    assert tokens.prompt(TraceRequest(3, 0, 512, 1, (4,))) == a[:512]


@pytest.mark.parametrize("block_size", [16, 64, 512, 48])
def test_trace_prompt_hashes_are_the_prompts_block_hashes(block_size: int) -> None:
    tokens = TraceTokens(trace_block_size=128, vocab_size=1000)
    for request in (TraceRequest(1, 0, 300, 1, (1, 2, 3)), TraceRequest(2, 0, 256, 1, (1, 2))):
        prompt, hashes = tokens.prompt_and_hashes(request, block_size)
        assert prompt == tokens.prompt(request) and hashes == block_hashes(prompt, block_size)


def test_trace_ids_beyond_64_bits_and_negative_ones_get_tokens_of_their_own() -> None:
    tokens = TraceTokens(trace_block_size=64, vocab_size=1000)
    ids = (5, 5 + (1 << 64), -1, (1 << 64) - 1, 1 << 70)
    prompts = [tokens.prompt(TraceRequest(i, 0, 64, 1, (hash_id,))) for i, hash_id in enumerate(ids)]
    assert len({tuple(p) for p in prompts}) == len(ids)


def test_summary_figures() -> None:
    records = [
        RequestRecord(0, "w0", 100, 1000, 10, 1000, 500),
        RequestRecord(500, "w1", 700, 1500, 5, 1000, 0),
        RequestRecord(600, "w1", error="rejected"),
    ]
    f = summarize(records, "kv").figures
    assert f["completed"] == 2 and f["failed"] == 1
    assert f["hit_rate"] == 0.25  # 500 cached of 2000 prompt tokens
    assert f["ttft_mean_ms"] == 150.0 and f["ttft_p99_ms"] == 200.0
    assert f["tpot_mean_ms"] == pytest.approx((900 / 9 + 800 / 4) / 2, abs=0.01)
    assert f["requests_per_s"] == pytest.approx(2 / 1.5, abs=1e-3)
    assert (f["worker_requests_min"], f["worker_requests_max"]) == (1, 2)


def test_itl_pools_every_gap_tpot_is_per_request_and_goodput_counts_requests_meeting_the_slo() -> None:
    fast = RequestRecord(0, "w0", prompt_tokens=10)
    for t in (100, 110, 120, 130):  # first token at 100 ms, then one every 10 ms
        fast.emitted(t, 1)
    fast.finish_ms = 130
    slow = RequestRecord(0, "w1", prompt_tokens=10)
    slow.emitted(50, 1)
    slow.emitted(250, 2)  # two tokens in one output: two gaps of 100 ms
    slow.finish_ms = 250
    assert fast.gaps == [10, 10, 10] and slow.gaps == [100, 100]
    f = summarize([fast, slow], "kv", {"ttft": 80, "tpot": 50}).figures
    assert f["tpot_mean_ms"] == pytest.approx((10 + 100) / 2)
    assert f["itl_p50_ms"] == 10 and f["itl_p99_ms"] == 100  # 5 gaps pooled
    # Neither meets both targets (fast: TTFT 100 > 80; slow: TPOT 100 > 50).
    assert f["goodput"] == 0.0 and f["good_fraction"] == 0.0
    f = summarize([fast, slow], "kv", {"tpot": 50}).figures
    assert f["good_fraction"] == 0.5 and f["goodput"] == pytest.approx(1 / 0.25)


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason=f"the shared trace is not at {SHARED_TRACE}")
def test_offline_replay_of_disaggregated_pools(capsys: pytest.CaptureFixture[str]) -> None:
    common = [
        str(SHARED_TRACE),
        "--max-requests",
        "200",
        "--num-blocks",
        "8192",
        "--slo",
        "ttft=2000,tpot=50",
    ]
    pools = ["--prefill-workers", "2", "--decode-workers", "2"]
    whole, _ = replay_json(capsys, *common, "--workers", "4")
    always, _ = replay_json(capsys, *common, *pools, "--disaggregation", "always")
    never, _ = replay_json(capsys, *common, *pools, "--disaggregation", "never")
    adaptive, _ = replay_json(capsys, *common, *pools)
    assert whole["completed"] == always["completed"] == never["completed"] == adaptive["completed"] == 200
    assert always["disaggregated_share"] == 1.0 and never["disaggregated_share"] == 0.0
    assert adaptive["disaggregation"] == "adaptive" and 0 < adaptive["disaggregated_share"] < 1
    assert "disaggregated_share" not in whole
    # The prefill pool's cache hits are the requests' own: the shared trace reuses prefixes.
    assert always["hit_rate"] > 0
    for figures in (whole, always, never, adaptive):
        assert isinstance(figures["goodput"], float) and figures["goodput"] > 0
    assert weir(["replay", str(SHARED_TRACE), "--prefill-workers", "1"]) == 2  # needs decode workers too


def replay_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, float], str]:
    """The final JSON line of `weir replay ARGS`, and what it wrote to stderr."""
    assert weir(["replay", *args]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason=f"the shared trace is not at {SHARED_TRACE}")
def test_offline_replay_of_a_trace_slice_kv_beats_round_robin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [str(SHARED_TRACE), "--workers", "4", "--max-requests", "300", "--num-blocks", "8192"]
    kv, _ = replay_json(capsys, *common, "--router-mode", "kv", "--output-file", str(tmp_path / "kv.json"))
    rr, _ = replay_json(capsys, *common, "--router-mode", "round-robin")
    assert kv["completed"] == rr["completed"] == 300
    assert kv["hit_rate"] > rr["hit_rate"] > 0
    assert kv["ttft_mean_ms"] < rr["ttft_mean_ms"]
    assert json.loads((tmp_path / "kv.json").read_text()) == kv
    for key in ("hit_rate", "ttft_mean_ms", "ttft_p99_ms", "e2e_p99_ms", "requests_per_s"):
        assert isinstance(kv[key], float)


def test_replay_kv_eviction_slru_and_arc_keep_a_reused_prefix_through_one_off_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One worker of 64 blocks: a two-block prefix (16 engine blocks) is sent twice, so it is
    reused; then ten one-off prompts of one trace block (80 blocks in all) pass through; then
    the prefix again. LRU has evicted it by then; segmented LRU kept it protected, and so did
    ARC's adaptive split, which no evicted block came back to move."""
    lines = [(1, 2), (1, 2), *((100 + i,) for i in range(10)), (1, 2)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {"timestamp": 10_000 * i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}
            )
            + "\n"
            for i, ids in enumerate(lines)
        )
    )
    common = [str(trace), "--workers", "1", "--num-blocks", "64", "--block-size", "64"]
    lru, _ = replay_json(capsys, *common)
    slru, _ = replay_json(capsys, *common, "--kv-eviction", "slru")
    arc, _ = replay_json(capsys, *common, "--kv-eviction", "arc")
    assert lru["completed"] == slru["completed"] == arc["completed"] == len(lines)
    # Cached prompt tokens: the second prefix request's first 15 blocks (the last block of a
    # prompt is computed again, for its logits) under both; the last one's under segmented LRU
    # only.
    prompt_tokens = 512 * sum(len(ids) for ids in lines)
    assert lru["hit_rate"] == round(15 * 64 / prompt_tokens, 4)
    assert slru["hit_rate"] == arc["hit_rate"] == round(2 * 15 * 64 / prompt_tokens, 4)


def test_offline_replay_with_kv_tiers_caches_more_and_answers_sooner(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Device caches too small for the slice's reuse: a host tier per worker keeps what they
    # evict, and a shared tier serves one worker's prefixes to the others.
    # (One request of the slice needs more KV than such a worker holds: it fails in every run.)
    common = [str(SHARED_TRACE), "--workers", "4", "--max-requests", "300", "--num-blocks", "2048"]
    device, _ = replay_json(capsys, *common)
    host, _ = replay_json(capsys, *common, "--host-cache-blocks", "8192")
    shared, _ = replay_json(capsys, *common, "--host-cache-blocks", "8192", "--shared-cache-blocks", "65536")
    assert device["completed"] == host["completed"] == shared["completed"] == 299
    assert device["hit_rate"] < host["hit_rate"] < shared["hit_rate"]
    assert host["ttft_mean_ms"] < device["ttft_mean_ms"]
    # Loads are not free: the same tier at a 76th of the bandwidth makes requests wait.
    slow, _ = replay_json(capsys, *common, "--host-cache-blocks", "8192", "--kv-bytes-per-token", "10000000")
    assert slow["ttft_mean_ms"] > host["ttft_mean_ms"]


def test_offline_replay_reports_bad_lines_and_block_size_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join([line(0, 40, 3, [0, 1, 2]), "oops", line(1000, 40, 3, [0, 1, 9])]) + "\n")
    figures, err = replay_json(
        capsys, str(trace), "--workers", "2", "--trace-block-size", "16", "--block-size", "4"
    )
    assert "t.jsonl:2: malformed trace line skipped" in err
    # stderr is not a TTY here: the two lines and no progress bar
    assert len(err.splitlines()) == 2 and err.splitlines()[1].startswith("replayed 2 requests in ")
    assert figures["completed"] == 2
    # the second request shares 32 of its 40 prompt tokens with the first: 32 of 80 in all
    assert figures["hit_rate"] == 0.4
    assert weir(["replay", str(trace), "--trace-block-size", "16", "--block-size", "5"]) == 2


def test_offline_replay_reports_each_request_once_as_it_ends() -> None:
    config = MockerConfig(num_blocks=16, block_size=16)  # 256 tokens of KV per worker
    trace = [TraceRequest(i, i * 10.0, 64, 3, (i,)) for i in range(5)]
    trace.append(TraceRequest(5, 60.0, 512, 3, (5, 6, 7, 8)))  # more than a worker's KV: an error
    seen: list[RequestRecord] = []
    tokens = TraceTokens(trace_block_size=128, vocab_size=1000)
    records = OfflineReplay(make_router("round-robin", 16), config, 2, tokens).run(trace, seen.append)
    assert sorted(map(id, seen)) == sorted(map(id, records)) and len(records) == 6
    assert [r.error is not None for r in records].count(True) == 1
    assert all(r.finish_ms is not None for r in seen if r.error is None)  # reported once finished


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason=f"the shared trace is not at {SHARED_TRACE}")
@pytest.mark.parametrize(("router_mode", "host_cache_blocks"), [("kv", 0), ("ttft", 4096)])
def test_decode_stretches_replay_as_single_steps_do(
    monkeypatch: pytest.MonkeyPatch, router_mode: str, host_cache_blocks: int
) -> None:
    # Runs of identical decode steps are one event each; every request's worker, cached
    # tokens and times come out as stepping one at a time gives them, in far fewer steps.
    trace, _ = read_trace(SHARED_TRACE)
    trace = trace[:400]
    steps = {True: 0, False: 0}
    real_step = MockerCore.step

    def records(stretches: bool) -> list[tuple[object, ...]]:
        def counted(core: MockerCore) -> StepResult:
            steps[stretches] += 1
            return real_step(core)

        monkeypatch.setattr(MockerCore, "step", counted)
        clock = VirtualClock()
        config = MockerConfig(num_blocks=4096, context_length=1 << 18, host_cache_blocks=host_cache_blocks)
        router = make_router(router_mode, 64, clock=clock, seed=7)
        replay = OfflineReplay(router, config, 4, TraceTokens(), clock=clock, stretches=stretches)
        return [
            (r.worker_id, r.cached_tokens, r.output_tokens, r.first_token_ms, r.finish_ms, r.error, r.gaps)
            for r in replay.run(trace)
        ]

    stepped, stretched = records(False), records(True)
    assert len(stretched) == 400 and all(r[5] is None for r in stretched)
    assert [(*r[:3], r[5]) for r in stretched] == [(*r[:3], r[5]) for r in stepped]
    for fast, slow in zip(stretched, stepped, strict=True):
        assert fast[3:5] == slow[3:5]  # the same sums of the same step times
        assert fast[6] == pytest.approx(slow[6], rel=1e-9)  # a stretch's gaps: its time / steps
    assert steps[True] * 5 < steps[False]


def shared_prefix_trace(path: Path, requests: int = 160, rate: float = 8.0) -> Path:
    """Poisson arrivals; six system prompts of 2-5 blocks, each request's own 1-3 after."""
    rng = random.Random(1)
    at, fresh, lines = 0.0, 1000, []
    for _ in range(requests):
        at += rng.expovariate(rate) * 1e3
        group = rng.randrange(6)
        own = rng.randint(1, 3)
        ids = [*range(group * 10, group * 10 + 2 + group % 4), *range(fresh, fresh + own)]
        fresh += own
        lines.append(line(round(at, 3), 512 * len(ids) - rng.randrange(400), rng.randint(20, 120), ids))
    path.write_text("".join(f"{text}\n" for text in lines))
    return path


def test_online_and_offline_replays_of_one_trace_agree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The live router, engines and clock against the simulation of the same: `weir replay
    # --url` at a live `weir serve --backend mocker` (real time) and the offline replay, same
    # trace, workers and KV size, agree on hit rate within 2 % and mean TTFT within 10 %
    # (the live one also pays the frontend's and HTTP's time: about 5 % on a quiet machine).
    # The live replay runs twice, each on a fresh server, and the faster run counts: other
    # processes on the machine can only add to a live run's latency (one CI run measured 50.1
    # against 42.6 ms where quiet runs give 44.6-44.9), and the least delayed run is the
    # estimate of the system itself.
    trace = str(shared_prefix_trace(tmp_path / "t.jsonl"))
    common = ["--block-size", "64", "--num-blocks", "16384", "--router-mode", "kv"]
    offline, _ = replay_json(capsys, trace, "--workers", "2", *common)
    argv = ["serve", "--backend", "mocker", "--workers", "2", "--speedup", "1", *common, "--port", "0"]
    runs = []
    for attempt in range(2):
        log = tmp_path / f"serve-{attempt}.log"
        with weir_process(*argv, log=log) as proc:
            url = wait_banner(proc, log)
            assert weir(["replay", trace, "--url", url, "--trace-speedup", "1"]) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["points"][0])
    online = min(runs, key=lambda run: run["ttft_mean_ms"])
    assert all(run["completed"] == 160 for run in runs)
    assert online["completed"] == offline["completed"] == 160
    assert offline["hit_rate"] > 0.5  # the system prompts are shared
    assert online["cache_hit_rate"] == pytest.approx(offline["hit_rate"], rel=0.02)
    assert online["ttft_mean_ms"] == pytest.approx(offline["ttft_mean_ms"], rel=0.10)


def test_online_replay_is_weir_bench_on_the_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the mocker caches 64-token blocks: 4 requests share each first block, so with two
    # workers at least two requests find their first block cached wherever they land
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(line(i * 20.0, 192, 4, [i % 2, 10 + i % 3, 100 + i]) + "\n" for i in range(8)))
    with live_frontend(build_chatml(tmp_path / "tok"), num_workers=2, router_mode="kv") as live:
        argv = ["replay", str(trace), "--url", live.url, "--trace-block-size", "64", "--vocab-size", "300"]
        code = weir([*argv, "--trace-speedup", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    point = json.loads(out.strip().splitlines()[-1])["points"][0]
    assert (point["load"], point["completed"], point["errors"]) == ("trace x2", 8, {}), point
    assert point["cache_hit_rate"] > 0 and point["ttft_p99_ms"] is not None, point
    assert weir(["replay", str(trace), "--url", live.url, "--output-file", str(tmp_path / "x")]) == 2
