"""`weir bench` end to end: the real command against `weir serve --backend mocker` and, with
`--direct`, that server's own worker over the request plane, in one run."""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli.procs import wait_banner, wait_healthy, weir, weir_process

pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n"


@dataclass
class Served:
    url: str
    worker: str  # the worker's request-plane address, from the banner


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with weir_process("serve", "--backend", "mocker", "--port", "0", log=log) as proc:
        url = wait_banner(proc, log)
        wait_healthy(url, proc, log)
        worker = re.search(r"worker at (\S+)\)", log.read_text())
        assert worker, log.read_text()
        yield Served(url, worker.group(1))


def bench(*args: str, timeout: float = 180.0) -> tuple[int, str, dict[str, object]]:
    """Exit code, stdout, and the JSON of its last line."""
    done = weir("bench", *args, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr
    return done.returncode, done.stdout, json.loads(lines[-1])


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as file:
        return list(csv.DictReader(file))


def test_weir_and_direct_side_by_side_with_ratios_and_plots(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, line = bench(
        "--url", served.url, "--direct", served.worker, "--concurrency", "1,4", "--num-requests", "12",
        "--input-tokens", "48", "--output-tokens", "8", "--warmup", "2", "--slo", "ttft=10000,tpot=1000",
        "--output", str(out),
    )  # fmt: skip
    assert code == 0, stdout
    points = line["points"]
    assert isinstance(points, list)
    assert [(p["target"], p["load"]) for p in points] == [
        ("weir", "concurrency 1"),
        ("direct", "concurrency 1"),
        ("weir", "concurrency 4"),
        ("direct", "concurrency 4"),
    ]
    for p in points:
        assert (p["completed"], p["failed"], p["errors"]) == (12, 0, {}), p
        assert p["ttft_p50_ms"] <= p["ttft_p99_ms"] < p["e2e_p99_ms"], p
        assert p["good_fraction"] == 1.0 and p["goodput"] == p["request_throughput"], p  # a loose SLO
    ratios = line["ratios"]
    assert isinstance(ratios, list) and [r["load"] for r in ratios] == ["concurrency 1", "concurrency 4"]
    weir_c1, direct_c1 = points[0], points[1]
    assert ratios[0]["ttft_p50_ms"] == pytest.approx(
        weir_c1["ttft_p50_ms"] / direct_c1["ttft_p50_ms"], rel=2e-3
    )
    assert "| weir/direct | concurrency 4 |" in stdout  # the Markdown table's ratio row

    result = json.loads((out / "result.json").read_text())
    config = result["configuration"]
    workload = config["workload"]
    assert workload["vocab_size"] > 1000  # the worker's tokenizer's, fetched over the request plane
    assert {k: v for k, v in workload.items() if k != "vocab_size"} == {
        "kind": "random", "seed": 0, "sessions": 12, "requests": 12
    }  # fmt: skip
    assert config["targets"]["weir"]["models"]["data"][0]["id"]  # the server's /v1/models card
    assert config["targets"]["direct"]["kind"] == "weir-worker"
    assert len(config["load_average_before"]) == 3 and config["weir_version"]
    requests = rows(out / "requests.csv")
    assert len(requests) == 4 * 12  # warm-up requests are not results
    assert {r["output_tokens"] for r in requests} == {"8"}  # ignore_eos: exact output lengths
    assert {r["input_tokens"] for r in requests} == {"48"}  # token-id prompts: exact input lengths
    for name in ("latency_vs_throughput", "goodput", "distributions", "direct_vs_weir"):
        assert (out / f"{name}.png").read_bytes().startswith(PNG), name


def test_multi_turn_chat_grows_its_history_and_hits_the_cache(served: Served, tmp_path: Path) -> None:
    # The tokenizer comes from the --direct worker (its model_files), so chat prompts are text.
    out = tmp_path / "out"
    code, stdout, line = bench(
        "--url", served.url, "--direct", served.worker, "--workload", "multi-turn", "--endpoint", "chat",
        "--num-requests", "4", "--turns", "3", "--input-tokens", "70", "--output-tokens", "6",
        "--concurrency", "2", "--output", str(out),
    )  # fmt: skip
    assert code == 0, stdout
    by_turn: dict[tuple[str, str], dict[str, int]] = {}
    for r in rows(out / "requests.csv"):
        assert not r["error"], r
        by_turn.setdefault((r["target"], r["session"]), {})[r["turn"]] = int(r["input_tokens"])
    assert len(by_turn) == 8
    for turns in by_turn.values():
        assert turns["0"] < turns["1"] < turns["2"], turns  # each turn's prompt holds the last one
    points = line["points"]
    assert isinstance(points, list)
    assert all(p["cache_hit_rate"] > 0.2 for p in points), points  # later turns reuse earlier ones


def test_trace_on_its_timestamps_at_a_scale(served: Served, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]},
        {"timestamp": 200, "input_length": 1024, "output_length": 4, "hash_ids": [0, 2]},
        {"timestamp": 400, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]},
        {"timestamp": 800, "input_length": 512, "output_length": 4, "hash_ids": [3]},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    code, stdout, _ = bench(
        "--url", served.url, "--workload", "trace", "--trace", str(trace), "--scale", "8",
        "--trace-speedup", "2", "--output", str(out),
    )  # fmt: skip
    assert code == 0, stdout
    requests = sorted(rows(out / "requests.csv"), key=lambda r: int(r["session"]))
    assert [int(r["input_tokens"]) for r in requests] == [128, 128, 75, 64]
    starts = [float(r["start_s"]) for r in requests]
    for start, at in zip(starts, (0.0, 0.1, 0.2, 0.4), strict=True):
        assert at <= start - starts[0] + 1e-3, (starts, at)  # never before its (sped-up) timestamp


def test_open_loop_rate_sweep(served: Served, tmp_path: Path) -> None:
    code, stdout, line = bench(
        "--url", served.url, "--request-rate", "20,40", "--num-requests", "10",
        "--input-tokens", "uniform:8,64", "--output-tokens", "normal:6,2", "--output", str(tmp_path),
    )  # fmt: skip
    assert code == 0, stdout
    points = line["points"]
    assert isinstance(points, list)
    assert [p["load"] for p in points] == ["rate 20/s", "rate 40/s"]
    assert all(p["completed"] == 10 for p in points), points
    lengths = {int(r["input_tokens"]) for r in rows(tmp_path / "requests.csv")}
    assert len(lengths) > 3 and min(lengths) >= 8 and max(lengths) <= 64, lengths
    assert (tmp_path / "goodput.png").read_bytes().startswith(PNG)


def test_repeats_report_medians_and_ranges_and_options_reach_the_body(served: Served, tmp_path: Path) -> None:
    # --extra-body reaches every request: max_tokens 3 overrides --output-tokens 8.
    # --no-ignore-eos: the mocker may then end early, but never past max_tokens.
    code, stdout, line = bench(
        "--url", served.url, "--num-requests", "6", "--input-tokens", "16", "--output-tokens", "8",
        "--repeats", "3", "--no-ignore-eos", "--extra-body", '{"max_tokens": 3}', "--output", str(tmp_path),
    )  # fmt: skip
    assert code == 0, stdout
    point = json.loads((tmp_path / "result.json").read_text())["points"][0]
    assert point["repeats"] == 3 and point["completed"] == 6, point
    low, high = point["ranges"]["ttft_p50_ms"]
    assert low <= point["ttft_p50_ms"] <= high, point
    requests = rows(tmp_path / "requests.csv")
    assert sorted({r["repeat"] for r in requests}) == ["0", "1", "2"] and len(requests) == 18
    assert all(1 <= int(r["output_tokens"]) <= 3 for r in requests), requests
    assert line["points"][0]["completed"] == 6  # type: ignore[index]


def test_failures_are_counted_by_type_and_fail_the_command(served: Served) -> None:
    code, _, line = bench("--url", served.url, "--model", "no-such-model", "--num-requests", "3")
    assert code == 1  # no request of the load completed: a broken setup, not a figure
    points = line["points"]
    assert isinstance(points, list)
    assert points[0]["errors"] == {"http_404": 3} and points[0]["completed"] == 0, points


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "trace"], "--workload trace needs --trace FILE"),
        (["--trace-speedup", "2"], "--trace-speedup goes with --workload trace"),
        (["--request-rate", "5", "--concurrency", "1,2"], "takes one value"),
        (["--endpoint", "chat"], "chat prompts are text: give --tokenizer"),
    ],
)
def test_contradictory_options_are_usage_errors(served: Served, args: list[str], message: str) -> None:
    done = weir("bench", "--url", served.url, "--num-requests", "1", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize(
    "args", [["--slo", "latency=5"], ["--input-tokens", "uniform:9,3"], ["--concurrency", "0"]]
)
def test_malformed_values_are_refused_by_the_parser(args: list[str]) -> None:
    done = weir("bench", "--url", "http://127.0.0.1:9", *args)
    assert done.returncode == 2 and "error:" in done.stderr, done.stderr
