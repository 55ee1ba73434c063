"""PNG charts of a benchmark (matplotlib, the `plots` extra), one file per question:

- latency_vs_throughput.png: TTFT and TPOT p50/p99 against output throughput across the
  sweep, one line per target: where the knee is.
- goodput.png: goodput (or request throughput, with no --slo) against the offered load.
- distributions.png: TTFT and ITL histograms of every target at every load.
- direct_vs_weir.png: per load, Weir's figures over the direct engine's (only with --direct).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt
import numpy as np

from orchestrator.bench.report import Point, ratios
from orchestrator.bench.stats import latencies_ms


def draw(out: Path, points: list[Point]) -> list[Path]:
    targets = list(dict.fromkeys(p.target for p in points))
    written = [_latency_vs_throughput(out, points, targets), _goodput(out, points, targets)]
    written.append(_distributions(out, points, targets))
    if len(targets) == 2:
        written.append(_direct_vs_weir(out, points, targets[0], targets[1]))
    return written


def _series(points: list[Point], target: str, figure: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for p in points:
        f = p.figures
        x, y = f.get("output_token_throughput"), f.get(figure)
        if p.target == target and x is not None and y is not None:
            xs.append(float(x))
            ys.append(float(y))
    return xs, ys


def _latency_vs_throughput(out: Path, points: list[Point], targets: list[str]) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for target in targets:
            for q, style in (("p50", "-o"), ("p99", "--s")):
                xs, ys = _series(points, target, f"{metric}_{q}_ms")
                ax.plot(xs, ys, style, label=f"{target} {q}")
            for p in points:  # label each marker with its load
                x, y = p.figures.get("output_token_throughput"), p.figures.get(f"{metric}_p50_ms")
                if p.target == target and x is not None and y is not None:
                    ax.annotate(p.load.label, (float(x), float(y)), fontsize=7, alpha=0.7)
        ax.set_xlabel("output tokens / s")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_title(f"{metric.upper()} against throughput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "latency_vs_throughput.png")


def _offered(p: Point) -> float:
    load = p.load
    return float(load.rate or load.trace_speedup or load.concurrency or 0)


def _goodput(out: Path, points: list[Point], targets: list[str]) -> Path:
    has_slo = any(p.figures.get("goodput") is not None for p in points)
    figure = "goodput" if has_slo else "request_throughput"
    load = points[0].load
    xlabel = "request rate (/s)" if load.rate else "trace speedup" if load.trace_speedup else "concurrency"
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for target in targets:
        mine = sorted((p for p in points if p.target == target), key=_offered)
        ax.plot(
            [_offered(p) for p in mine], [float(p.figures.get(figure) or 0) for p in mine], "-o", label=target
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("goodput (requests / s)" if has_slo else "requests / s")
    ax.set_title("goodput against load" if has_slo else "throughput against load (no --slo given)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "goodput.png")


def _distributions(out: Path, points: list[Point], targets: list[str]) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric in zip(axes, ("ttft", "itl"), strict=True):
        low, high = float("inf"), 0.0
        for p in points:
            values = [v for records in p.records for v in latencies_ms(records)[metric]]
            if values:
                # Bins over the bulk (to p99.5): a few stalls would squeeze the rest into one bin.
                span = (min(values), float(np.percentile(values, 99.5)))
                low, high = min(low, span[0]), max(high, span[1])
                ax.hist(values, bins=50, range=span, histtype="step", label=f"{p.target} {p.load.label}")
        if high > low:
            ax.set_xlim(low, high)
        ax.set_xlabel(f"{metric.upper()} (ms, to p99.5)")
        ax.set_ylabel("count")
        ax.set_title(f"{metric.upper()} distribution")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out / "distributions.png")


def _direct_vs_weir(out: Path, points: list[Point], weir: str, direct: str) -> Path:
    rows = ratios(points, weir, direct)
    shown = ("request_throughput", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "e2e_p50_ms")
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(shown)
    for i, name in enumerate(shown):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [row.get(name) or 0.0 for row in rows], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [row["load"] for row in rows])
    ax.set_ylabel(f"{weir} / {direct}")
    ax.set_title(f"{weir} over {direct}, figure by figure (1 = no difference)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out / "direct_vs_weir.png")


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
