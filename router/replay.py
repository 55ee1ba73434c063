"""Trace replay, the parts every driver shares: reading Mooncake traces, turning their block
ids into tokens, and summarising what happened.

A Mooncake trace line is `{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`: prompt block i (of `trace_block_size` tokens, 512 in Mooncake's) is
named by `hash_ids[i]`, and equal ids mean equal content with an equal prefix. Tokens are
derived from the id alone, so equal ids give equal tokens and hence equal engine block
hashes at any engine block size. The drivers live above the router: the offline one in
`backends.mocker.replay` (it runs mocker engines); online, `weir bench --workload trace`
(`orchestrator/bench/`) sends the same tokens to a running server.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import xxhash

from orchestrator.runtime.hashing import hash_words

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class _TraceLine(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def read_trace(path: str | Path, trace_block_size: int = 512) -> tuple[list[TraceRequest], list[str]]:
    """The trace's requests in arrival order, and one message per malformed line (skipped)."""
    decoder = msgspec.json.Decoder(_TraceLine)
    requests: list[TraceRequest] = []
    errors: list[str] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                line = decoder.decode(raw)
            except msgspec.DecodeError as exc:
                errors.append(f"{path}:{number}: malformed trace line skipped: {exc}")
                continue
            problem = _check(line, trace_block_size)
            if problem:
                errors.append(f"{path}:{number}: malformed trace line skipped: {problem}")
                continue
            requests.append(
                TraceRequest(
                    number, line.timestamp, line.input_length, line.output_length, tuple(line.hash_ids)
                )
            )
    requests.sort(key=lambda r: r.timestamp_ms)  # stable: equal timestamps keep file order
    return requests, errors


def _check(line: _TraceLine, trace_block_size: int) -> str | None:
    if line.input_length <= 0 or line.output_length <= 0:
        return "input_length and output_length must be positive"
    if not math.isfinite(line.timestamp) or line.timestamp < 0:
        return "timestamp must be a non-negative number of milliseconds"
    blocks = -(-line.input_length // trace_block_size)
    if len(line.hash_ids) != blocks:
        return f"{line.input_length} input tokens need {blocks} hash_ids, got {len(line.hash_ids)}"
    return None


_U64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over uint64 (wrapping): a different, well-spread value per input."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _u64(hash_id: int) -> int:
    """The id itself where it fits 64 bits, else a 64-bit hash of it (never a truncation, which
    would give ids that differ only above bit 63 the same tokens)."""
    return hash_id if 0 <= hash_id <= _U64 else xxhash.xxh3_64_intdigest(str(hash_id).encode())


# Trace blocks' tokens are windows of one fixed pseudo-random stream of this many tokens.
STREAM_TOKENS = 1 << 20


class TraceTokens:
    """Deterministic synthetic tokens for trace blocks. The block named `hash_id` holds a
    window of one fixed pseudo-random token stream, at an offset hashed from the id, with its
    first token hashed from the id too: two ids share their tokens only if both hashes meet
    (odds of 1 in `STREAM_TOKENS` times the vocabulary per pair). A prompt is then a few
    slices of the stream joined, where drawing each of a replay's 61M prompt tokens was a
    quarter of its time."""

    def __init__(self, trace_block_size: int = 512, vocab_size: int = 32_000) -> None:
        self.trace_block_size = trace_block_size
        self.vocab_size = vocab_size
        positions = np.arange(STREAM_TOKENS + trace_block_size, dtype=np.uint64)
        self._stream_words = (_mix(positions) % np.uint64(vocab_size)).astype("<u4")
        # Each token value is one shared int object, so a prompt's list allocates no ints.
        self._ints = list(range(vocab_size))
        self._stream: list[int] = np.array(self._ints, dtype=object)[self._stream_words].tolist()
        self._columns = np.arange(trace_block_size)

    def prompt(self, request: TraceRequest) -> list[int]:
        return self._tokens(*self._windows(request), request.input_length)

    def prompt_and_hashes(self, request: TraceRequest, block_size: int) -> tuple[list[int], list[int]]:
        """`prompt(request)` and its `orchestrator.runtime.hashing.block_hashes` at
        `block_size`, hashed from the stream's u32 words without converting the list back."""
        offsets, firsts = self._windows(request)
        words = self._stream_words[offsets[:, None] + self._columns]
        words[:, 0] = firsts
        data = words.reshape(-1)[: request.input_length].tobytes()
        return self._tokens(offsets, firsts, request.input_length), hash_words(data, block_size)

    def _windows(self, request: TraceRequest) -> tuple[np.ndarray, np.ndarray]:
        """Per block of the prompt: where its window starts in the stream, and its first token."""
        ids = _mix(np.array([_u64(hash_id) for hash_id in request.hash_ids], dtype=np.uint64))
        offsets = (ids % np.uint64(STREAM_TOKENS)).astype(np.intp)
        firsts = (_mix(ids) % np.uint64(self.vocab_size)).astype(np.uint32)
        return offsets, firsts

    def _tokens(self, offsets: np.ndarray, firsts: np.ndarray, length: int) -> list[int]:
        stream, ints, size = self._stream, self._ints, self.trace_block_size
        tokens: list[int] = []
        for offset, first in zip(offsets.tolist(), firsts.tolist(), strict=True):
            start = len(tokens)
            tokens += stream[offset : offset + size]
            tokens[start] = ints[first]
        del tokens[length:]
        return tokens


# ---------------------------------------------------------------------------- results


@dataclass(slots=True)
class RequestRecord:
    """One replayed request's timeline (milliseconds on the driver's clock). `gaps`: the time
    between each output and the one before it, per token (an output of k tokens is k gaps of
    a k-th of its wait), so they pool into the inter-token latency."""

    arrival_ms: float
    worker_id: str = ""
    first_token_ms: float | None = None
    finish_ms: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    gaps: list[float] = field(default_factory=list)
    last_token_ms: float | None = None

    def emitted(self, now_ms: float, num_tokens: int) -> None:
        """An output of `num_tokens` tokens at `now_ms`."""
        if not num_tokens:
            return
        if self.last_token_ms is None:
            self.first_token_ms = now_ms
            num_tokens -= 1
            self.output_tokens += 1
        if num_tokens:
            self.gaps += [(now_ms - (self.last_token_ms or now_ms)) / num_tokens] * num_tokens
            self.output_tokens += num_tokens
        self.last_token_ms = now_ms

    @property
    def tpot_ms(self) -> float | None:
        if self.first_token_ms is None or self.finish_ms is None or self.output_tokens < 2:
            return None
        return (self.finish_ms - self.first_token_ms) / (self.output_tokens - 1)


@dataclass(slots=True)
class Summary:
    figures: dict[str, float | int | str | None] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)], 2)


def summarize(
    records: Sequence[RequestRecord], label: str, slo: Mapping[str, float] | None = None
) -> Summary:
    """The figures, with weir bench's conventions: TTFT, TPOT per request ((e2e - TTFT) /
    (output tokens - 1)), ITL pooled over every token's gap, E2E. `slo`: targets in ms for
    any of "ttft", "tpot", "e2e"; goodput is the completed requests per second that met all."""
    done = [r for r in records if r.finish_ms is not None and r.error is None]
    ttft = [r.first_token_ms - r.arrival_ms for r in done if r.first_token_ms is not None]
    e2e = [r.finish_ms - r.arrival_ms for r in done if r.finish_ms is not None]
    tpot = [t for r in done if (t := r.tpot_ms) is not None]
    itl = [gap for r in done for gap in r.gaps]
    prompt = sum(r.prompt_tokens for r in done)
    span_s = (
        (max((r.finish_ms or 0.0) for r in done) - min(r.arrival_ms for r in records)) / 1e3 if done else 0.0
    )
    figures: dict[str, float | int | str | None] = {
        "router": label,
        "requests": len(records),
        "completed": len(done),
    }
    figures["failed"] = len(records) - len(done)
    figures["hit_rate"] = round(sum(r.cached_tokens for r in done) / prompt, 4) if prompt else 0.0
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        figures[f"{name}_mean_ms"] = round(statistics.fmean(values), 2) if values else None
        for q in (50, 90, 99):
            figures[f"{name}_p{q}_ms"] = _pct(values, q)
    figures["requests_per_s"] = round(len(done) / span_s, 3) if span_s else 0.0
    if slo is not None:
        good = sum(1 for r in done if _meets(r, slo))
        figures["goodput"] = round(good / span_s, 3) if span_s else 0.0
        figures["good_fraction"] = round(good / len(records), 4) if records else 0.0
    figures["output_tokens_per_s"] = round(sum(r.output_tokens for r in done) / span_s, 1) if span_s else 0.0
    per_worker = Counter(r.worker_id for r in records if r.worker_id)
    if per_worker:
        counts = list(per_worker.values())
        figures["worker_requests_min"] = min(counts)
        figures["worker_requests_max"] = max(counts)
        figures["worker_requests_cv"] = round(statistics.pstdev(counts) / statistics.fmean(counts), 3)
    return Summary(figures, dict(sorted(per_worker.items())))


def _meets(record: RequestRecord, slo: Mapping[str, float]) -> bool:
    assert record.finish_ms is not None
    measured = {
        "ttft": None if record.first_token_ms is None else record.first_token_ms - record.arrival_ms,
        "tpot": record.tpot_ms,
        "e2e": record.finish_ms - record.arrival_ms,
    }
    return all((value := measured[name]) is None or value <= target for name, target in slo.items())


def report(summary: Summary, output: str | None = None) -> None:
    """Human table on stdout, then the figures as one JSON line (also written to `output`)."""
    f = summary.figures
    print(
        f"router {f['router']}: {f['completed']}/{f['requests']} requests completed, hit rate {f['hit_rate']}"
    )
    print(f"{'':6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}  (ms)")
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = "".join(_cell(f[f"{name}_{k}_ms"]) for k in ("mean", "p50", "p90", "p99"))
        print(f"{name.upper():6}{row}")
    print(f"throughput: {f['requests_per_s']} requests/s, {f['output_tokens_per_s']} output tokens/s")
    if summary.workers:
        spread = ", ".join(f"{w}={n}" for w, n in summary.workers.items())
        print(f"requests per worker (cv {f['worker_requests_cv']}): {spread}")
    line = json.dumps(f)
    if output:
        Path(output).write_text(line + "\n")
    print(line)
    sys.stdout.flush()


def _cell(value: object) -> str:
    return f"{value:>10.1f}" if isinstance(value, float | int) else f"{'-':>10}"
