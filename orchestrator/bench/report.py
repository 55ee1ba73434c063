"""A benchmark's results: the Markdown table on stdout, the JSON, the per-request CSV.

A `Point` is one target under one load, measured `--repeats` times: its figures are the
medians over the repeats, with each figure's [min, max] range kept beside them. With a
`--direct` target every load also gets a ratio row, Weir over direct, figure by figure.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.bench.load import Load
from orchestrator.bench.stats import Figures, median_of
from orchestrator.bench.targets import RequestRecord

# (figure, column heading, digits) in table order.
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("request_throughput", "req/s", 2),
    ("output_token_throughput", "out tok/s", 1),
    ("ttft_p50_ms", "TTFT p50", 1),
    ("ttft_p99_ms", "TTFT p99", 1),
    ("tpot_p50_ms", "TPOT p50", 2),
    ("tpot_p99_ms", "TPOT p99", 2),
    ("itl_p50_ms", "ITL p50", 2),
    ("itl_p99_ms", "ITL p99", 2),
    ("e2e_p50_ms", "E2E p50", 1),
    ("e2e_p99_ms", "E2E p99", 1),
    ("goodput", "goodput req/s", 2),
    ("good_fraction", "good", 3),
    ("cache_hit_rate", "cached", 3),
)
# Figures whose ratio is reported, Weir over direct.
RATIOS = tuple(name for name, _, _ in COLUMNS if name not in ("good_fraction", "cache_hit_rate"))


@dataclass(slots=True)
class Point:
    target: str
    load: Load
    runs: list[Figures] = field(default_factory=list)
    records: list[list[RequestRecord]] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def figures(self) -> Figures:
        return median_of(self.runs)[0]

    def as_json(self) -> dict[str, Any]:
        medians, ranges = median_of(self.runs)
        return {
            "target": self.target,
            "load": self.load.label,
            "concurrency": self.load.concurrency,
            "request_rate": self.load.rate,
            "trace_speedup": self.load.trace_speedup,
            "repeats": len(self.runs),
            **medians,
            "errors": dict(self.errors),
            "ranges": ranges if len(self.runs) > 1 else {},
        }


def ratios(points: list[Point], over: str, under: str) -> list[dict[str, Any]]:
    """Per load, each figure of target `over` divided by target `under`'s."""
    by_load = {(p.target, p.load): p.figures for p in points}
    rows = []
    for p in points:
        if p.target != over or (under, p.load) not in by_load:
            continue
        base = by_load[(under, p.load)]
        row: dict[str, Any] = {"load": p.load.label}
        for name in RATIOS:
            a, b = p.figures.get(name), base.get(name)
            row[name] = round(float(a) / float(b), 3) if a is not None and b else None
        rows.append(row)
    return rows


def markdown(points: list[Point], ratio_rows: list[dict[str, Any]], ratio_label: str) -> str:
    head = ["target", "load", "ok/sent", *(title for _, title, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratio_by_load = {row["load"]: row for row in ratio_rows}
    loads = list(dict.fromkeys(p.load.label for p in points))
    for load in loads:
        for p in (p for p in points if p.load.label == load):
            f = p.figures
            cells = [p.target, load, f"{f['completed']:g}/{f['requests']:g}"]
            cells += [_cell(f.get(name), digits) for name, _, digits in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
        row = ratio_by_load.get(load)
        if row is not None:
            cells = [ratio_label, load, ""]
            cells += [_cell(row.get(name), 3) if name in RATIOS else "" for name, _, _ in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: object, digits: int) -> str:
    if isinstance(value, int | float) and math.isfinite(value):
        return f"{value:.{digits}f}"
    return "-"


def write_csv(path: Path, points: list[Point]) -> None:
    """Every request of every run, one row each."""
    fields = [
        "target", "load", "repeat", "session", "turn", "start_s", "ttft_ms", "tpot_ms", "e2e_ms",
        "input_tokens", "output_tokens", "cached_tokens", "chunks", "error", "error_detail",
    ]  # fmt: skip
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(fields)
        for p in points:
            for repeat, records in enumerate(p.records):
                for r in records:
                    tpot = r.tpot_s if r.ok else None
                    writer.writerow(
                        [
                            p.target,
                            p.load.label,
                            repeat,
                            r.session,
                            r.turn,
                            round(r.start_s, 6),
                            round(r.ttft_s * 1e3, 3) if r.ok else "",
                            round(tpot * 1e3, 3) if tpot is not None else "",
                            round(r.e2e_s * 1e3, 3) if r.ok else "",
                            r.input_tokens,
                            r.output_tokens,
                            "" if r.cached_tokens is None else r.cached_tokens,
                            len(r.chunk_s),
                            r.error or "",
                            r.error_detail,
                        ]
                    )


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")
