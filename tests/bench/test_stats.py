"""`weir bench` figures from hand-made request records (known chunk times), SLOs and goodput,
medians over repeats, and the report: Weir/direct ratios, the Markdown table, the CSV."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from orchestrator.bench.load import Load
from orchestrator.bench.report import COLUMNS, RATIOS, Point, markdown, ratios, write_csv
from orchestrator.bench.stats import PERCENTILES, Slo, errors_by_type, median_of, summarize
from orchestrator.bench.targets import RequestRecord


def _record(
    start: float,
    chunks: list[float],
    end: float | None = None,
    output: int | None = None,
    *,
    input_tokens: int = 100,
    cached: int | None = None,
    error: str | None = None,
    session: int = 0,
    turn: int = 0,
) -> RequestRecord:
    return RequestRecord(
        session,
        turn,
        start,
        input_tokens,
        chunk_s=chunks,
        end_s=(chunks[-1] if chunks else None) if end is None else end,
        output_tokens=len(chunks) if output is None else output,
        cached_tokens=cached,
        error=error,
    )


# Three completed requests with known times (seconds), and two failures.
A = _record(0.0, [0.1, 0.2, 0.4], end=0.5, output=5, input_tokens=100, cached=40)
B = _record(1.0, [1.3, 1.35], end=1.35, output=2, input_tokens=200, cached=0)
C = _record(2.0, [2.05], end=2.05, output=1, input_tokens=50)  # one token: no TPOT, no ITL
FAILED = _record(3.0, [3.1], end=None, output=0, input_tokens=999, error="timeout")
HTTP = _record(4.0, [], end=None, output=0, input_tokens=999, error="http_429")


def test_record_properties() -> None:
    assert A.ok and A.ttft_s == pytest.approx(0.1)
    assert A.e2e_s == pytest.approx(0.5)
    assert A.tpot_s == pytest.approx((0.5 - 0.1) / 4)
    assert A.itl_s == pytest.approx([0.1, 0.2])
    assert C.tpot_s is None and C.itl_s == []
    assert not FAILED.ok and not HTTP.ok
    assert not _record(0.0, [], end=1.0, output=0).ok  # no output chunk is not a completion


def test_summarize_latencies_match_their_definitions() -> None:
    figures = summarize([A, B, C, FAILED, HTTP], duration_s=5.0, slo=None)
    expected = {
        "ttft": [100.0, 300.0, 50.0],
        "tpot": [(500 - 100) / 4, (350 - 300) / 1],  # (e2e - ttft) / (output - 1); C has none
        "itl": [100.0, 200.0, 50.0],  # every gap of every request, pooled
        "e2e": [500.0, 350.0, 50.0],
    }
    for name, values in expected.items():
        assert figures[f"{name}_mean_ms"] == pytest.approx(np.mean(values), abs=1e-3)
        for q in PERCENTILES:
            assert figures[f"{name}_p{q}_ms"] == pytest.approx(np.percentile(values, q), abs=1e-3), (name, q)
    # Linear interpolation, not nearest rank: p90 of TTFT lies between samples.
    assert figures["ttft_p90_ms"] == pytest.approx(260.0, abs=1e-3)
    assert figures["itl_p50_ms"] == pytest.approx(100.0, abs=1e-3)


def test_summarize_counts_and_throughput_over_the_given_duration() -> None:
    figures = summarize([A, B, C, FAILED, HTTP], duration_s=4.0, slo=None)
    assert (figures["requests"], figures["completed"], figures["failed"]) == (5, 3, 2)
    assert figures["duration_s"] == 4.0
    assert figures["request_throughput"] == pytest.approx(3 / 4)
    assert figures["input_tokens"] == 350  # failures' 999 tokens not counted
    assert figures["output_tokens"] == 8
    assert figures["input_token_throughput"] == pytest.approx(350 / 4, abs=0.1)
    assert figures["output_token_throughput"] == pytest.approx(8 / 4, abs=0.1)
    assert figures["cached_tokens"] == 40
    # Over the requests that reported a cache figure: C's server said nothing about its 50.
    assert figures["cache_hit_rate"] == pytest.approx(40 / 300, abs=1e-4)
    assert "goodput" not in figures and "good_fraction" not in figures


def test_summarize_with_every_request_failed() -> None:
    figures = summarize([FAILED, HTTP], duration_s=0.0, slo=Slo(ttft_ms=1.0))
    assert (figures["requests"], figures["completed"], figures["failed"]) == (2, 0, 2)
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert figures[f"{name}_mean_ms"] is None
        assert all(figures[f"{name}_p{q}_ms"] is None for q in PERCENTILES)
    assert figures["request_throughput"] == 0.0
    assert figures["cache_hit_rate"] == 0.0
    assert figures["goodput"] == 0.0 and figures["good_fraction"] == 0.0
    assert summarize([], 1.0, Slo(ttft_ms=1.0))["good_fraction"] == 0.0


def test_errors_by_type() -> None:
    again = _record(5.0, [], error="http_429")
    assert errors_by_type([A, FAILED, HTTP, again, B]) == {"timeout": 1, "http_429": 2}
    assert errors_by_type([A, B]) == {}


# ---------------------------------------------------------------------------- SLOs


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ttft=500", Slo(ttft_ms=500.0)),
        ("ttft=500,tpot=50,e2e=10000", Slo(500.0, 50.0, 10000.0)),
        (" tpot=12.5 , e2e=3e3 ", Slo(tpot_ms=12.5, e2e_ms=3000.0)),
        ("e2e=1,", Slo(e2e_ms=1.0)),
    ],
)
def test_slo_parse(text: str, expected: Slo) -> None:
    assert Slo.parse(text) == expected


def test_slo_str_round_trips() -> None:
    slo = Slo.parse("ttft=500,e2e=2500.5")
    assert str(slo) == "ttft=500,e2e=2500.5"
    assert Slo.parse(str(slo)) == slo


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "at least one of ttft, tpot, e2e"),
        (",", "at least one"),
        ("ttft", "expected ttft=MS"),
        ("itl=5", "expected ttft=MS"),
        ("TTFT=5", "expected ttft=MS"),
        ("ttft=fast", "'fast' is not a number"),
        ("ttft=", "is not a number"),
        ("tpot=0", "must be a positive number"),
        ("e2e=-5", "must be a positive number"),
        ("ttft=nan", "must be a positive number"),  # would make goodput silently 0
        ("ttft=inf", "must be a positive number"),
    ],
)
def test_slo_parse_rejects_bad_input(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Slo.parse(text)


def test_goodput_counts_requests_meeting_every_target() -> None:
    slo = Slo(ttft_ms=200.0, tpot_ms=50.0)
    good = _record(0.0, [0.1, 0.13, 0.16], end=0.19, output=3)  # ttft 100, tpot 45
    good_one_token = _record(0.0, [0.15], end=0.15, output=1)  # no TPOT: only TTFT applies
    slow_tpot = _record(0.0, [0.1, 0.3], end=0.3, output=2)  # ttft 100, tpot 200
    slow_ttft = _record(0.0, [0.5, 0.51], end=0.52, output=3)  # ttft 500, tpot 10
    errored = _record(0.0, [0.01, 0.02], end=None, output=0, error="stream_error")  # fast, but failed
    assert [slo.met(r) for r in (good, good_one_token, slow_tpot, slow_ttft, errored)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    figures = summarize([good, good_one_token, slow_tpot, slow_ttft, errored], duration_s=4.0, slo=slo)
    assert figures["goodput"] == pytest.approx(2 / 4)
    assert figures["good_fraction"] == pytest.approx(2 / 5)  # over every request sent
    assert figures["request_throughput"] == pytest.approx(4 / 4)  # the errored one not completed


def test_e2e_target() -> None:
    slo = Slo.parse("e2e=300")
    assert slo.met(_record(1.0, [1.1, 1.2], end=1.29))
    assert not slo.met(_record(1.0, [1.1, 1.2], end=1.31))
    assert not Slo.parse("e2e=300,ttft=50").met(_record(1.0, [1.1, 1.2], end=1.29))


# ---------------------------------------------------------------------------- repeats


def test_median_of_repeats() -> None:
    runs: list[dict[str, float | int | None]] = [
        {"requests": 10, "completed": 9, "ttft_p50_ms": 12.0, "itl_p50_ms": None, "goodput": None},
        {"requests": 10, "completed": 7, "ttft_p50_ms": 30.0, "itl_p50_ms": 5.0, "goodput": None},
        {"requests": 10, "completed": 8, "ttft_p50_ms": 15.5, "itl_p50_ms": 3.0, "goodput": None},
    ]
    medians, ranges = median_of(runs)
    assert medians["requests"] == 10 and isinstance(medians["requests"], int)
    assert medians["completed"] == 8 and isinstance(medians["completed"], int)
    assert medians["ttft_p50_ms"] == 15.5
    assert medians["itl_p50_ms"] == 4.0  # over the repeats that have it
    assert isinstance(medians["itl_p50_ms"], float)  # a latency stays a float, even when whole
    assert medians["goodput"] is None  # missing in every repeat
    assert ranges["completed"] == [7, 9]
    assert ranges["ttft_p50_ms"] == [12.0, 30.0]
    assert ranges["itl_p50_ms"] == [3.0, 5.0]
    assert "goodput" not in ranges


def test_median_of_even_repeats_of_a_count() -> None:
    medians, ranges = median_of([{"completed": 3}, {"completed": 4}])
    assert medians["completed"] == 3.5  # no longer a whole count
    medians, _ = median_of([{"completed": 3}, {"completed": 5}])
    assert medians["completed"] == 4 and isinstance(medians["completed"], int)
    assert median_of([{"completed": 6}]) == ({"completed": 6}, {"completed": [6, 6]})
    assert ranges["completed"] == [3, 4]


# ---------------------------------------------------------------------------- report

C1, C4 = Load(concurrency=1), Load(concurrency=4)


def _figures(**values: float | int | None) -> dict[str, float | int | None]:
    figures: dict[str, float | int | None] = {"requests": 10, "completed": 10}
    figures.update({name: 1.0 for name, _, _ in COLUMNS})
    figures.update(values)
    return figures


def _points() -> list[Point]:
    return [
        Point("weir", C1, runs=[_figures(request_throughput=9.0, ttft_p50_ms=12.0, goodput=None)]),
        Point("direct", C1, runs=[_figures(request_throughput=10.0, ttft_p50_ms=10.0, itl_p50_ms=0.0)]),
        Point("weir", C4, runs=[_figures(request_throughput=30.0, completed=9)]),
        Point("direct", C4, runs=[_figures(request_throughput=40.0, e2e_p99_ms=None)]),
    ]


def test_ratios_are_weir_over_direct_per_load() -> None:
    rows = ratios(_points(), "weir", "direct")
    assert [row["load"] for row in rows] == ["concurrency 1", "concurrency 4"]
    one, four = rows
    assert set(one) == {"load", *RATIOS}
    assert one["request_throughput"] == pytest.approx(0.9)
    assert one["ttft_p50_ms"] == pytest.approx(1.2)
    assert one["output_token_throughput"] == pytest.approx(1.0)
    assert one["itl_p50_ms"] is None  # base is 0
    assert one["goodput"] is None  # numerator missing
    assert four["request_throughput"] == pytest.approx(0.75)
    assert four["e2e_p99_ms"] is None  # base missing
    # No base target at a load: no row.
    assert ratios([p for p in _points() if p.load == C1 or p.target == "weir"], "weir", "direct") == rows[:1]


def test_markdown_has_a_row_per_target_per_load_and_a_ratio_row() -> None:
    points = _points()
    text = markdown(points, ratios(points, "weir", "direct"), "weir/direct")
    lines = text.splitlines()
    assert len(lines) == 2 + 2 * 3
    head = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert head[:3] == ["target", "load", "ok/sent"]
    assert head[3:] == [title for _, title, _ in COLUMNS]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert all(len(row) == len(head) for row in rows)
    assert [row[:2] for row in rows] == [
        ["weir", "concurrency 1"],
        ["direct", "concurrency 1"],
        ["weir/direct", "concurrency 1"],
        ["weir", "concurrency 4"],
        ["direct", "concurrency 4"],
        ["weir/direct", "concurrency 4"],
    ]
    col = {title: 3 + i for i, (_, title, _) in enumerate(COLUMNS)}
    assert rows[0][2] == "10/10" and rows[3][2] == "9/10"
    assert rows[0][col["req/s"]] == "9.00"
    assert rows[0][col["goodput req/s"]] == "-"  # None
    assert rows[4][col["E2E p99"]] == "-"
    assert rows[2][col["req/s"]] == "0.900"
    assert rows[2][col["ITL p50"]] == "-"  # ratio over a zero base
    assert rows[2][col["good"]] == "" and rows[2][col["cached"]] == ""  # no ratio for fractions
    assert rows[2][2] == ""


def test_markdown_without_ratios() -> None:
    points = [p for p in _points() if p.target == "weir"]
    lines = markdown(points, [], "weir/direct").splitlines()
    assert len(lines) == 2 + 2
    assert not any("weir/direct" in line for line in lines)


def test_write_csv_one_row_per_request(tmp_path: Path) -> None:
    point = Point("weir", C1, runs=[{}, {}], records=[[A, FAILED], [B]])
    other = Point("direct", C4, records=[[C]])
    path = tmp_path / "requests.csv"
    write_csv(path, [point, other])
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == [
        "target", "load", "repeat", "session", "turn", "start_s", "ttft_ms", "tpot_ms", "e2e_ms",
        "input_tokens", "output_tokens", "cached_tokens", "chunks", "error", "error_detail",
    ]  # fmt: skip
    assert len(rows) == 4
    assert [(r["target"], r["load"], r["repeat"]) for r in rows] == [
        ("weir", "concurrency 1", "0"),
        ("weir", "concurrency 1", "0"),
        ("weir", "concurrency 1", "1"),
        ("direct", "concurrency 4", "0"),
    ]
    a, failed, b, c = rows
    assert float(a["ttft_ms"]) == pytest.approx(100.0)
    assert float(a["tpot_ms"]) == pytest.approx(100.0)
    assert float(a["e2e_ms"]) == pytest.approx(500.0)
    assert (a["input_tokens"], a["output_tokens"], a["cached_tokens"], a["chunks"]) == ("100", "5", "40", "3")
    assert failed["error"] == "timeout"
    assert failed["ttft_ms"] == failed["tpot_ms"] == failed["e2e_ms"] == ""
    assert float(b["start_s"]) == 1.0 and b["cached_tokens"] == "0"
    assert c["tpot_ms"] == "" and c["cached_tokens"] == "" and float(c["e2e_ms"]) == pytest.approx(50.0)
