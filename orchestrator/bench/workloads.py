"""What a benchmark sends: sessions of turns whose prompts are token ids, so lengths are exact.

Every workload is a list of `Session`s. A session's turns run one after another, each turn's
prompt being the session's history (earlier prompts and replies) plus its own new tokens; a
single-turn workload is sessions of one turn. Token ids are drawn from a seeded generator
below the vocabulary size, so a seed names a workload exactly.

- random: independent prompts, input and output lengths fixed or drawn from a distribution.
- shared-prefix: `groups` system prompts of `prefix` tokens, each request one group's prefix
  plus its own suffix (SGLang's generated-shared-prefix dataset).
- multi-turn: sessions of `turns` turns that grow by every reply and new user message.
- trace: a Mooncake-format trace on its timestamps; `scale` k divides input lengths by k and
  the trace's 512-token blocks become 512/k-token blocks, so equal hash ids still name equal
  token blocks and the trace's prefix sharing is kept at 1/k of the size.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from router.replay import TraceTokens, read_trace

MOONCAKE_BLOCK = 512


@dataclass(frozen=True, slots=True)
class Lengths:
    """A token count: fixed (`"128"`), uniform (`"uniform:64,256"`) or normal
    (`"normal:128,32"`, mean and standard deviation); never below 1."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Lengths:
        kind, _, values = text.partition(":")
        usage = f"{text!r}: expected N, uniform:MIN,MAX or normal:MEAN,STD, with whole 1 <= MIN <= MAX"
        try:
            if not values:
                n = int(kind)
                if n < 1:
                    raise ValueError(f"{text!r}: a length must be at least 1")
                return cls("fixed", n)
            a, b = (int(v) if kind == "uniform" else float(v) for v in values.split(","))
        except ValueError as exc:
            raise ValueError(str(exc) if "at least 1" in str(exc) else usage) from None
        if kind == "uniform" and 1 <= a <= b:
            return cls(kind, a, b)
        if kind == "normal" and math.isfinite(a) and math.isfinite(b) and a >= 1 and b >= 0:
            return cls(kind, a, b)
        raise ValueError(usage)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        return str(int(self.a)) if self.kind == "fixed" else f"{self.kind}:{self.a:g},{self.b:g}"


@dataclass(frozen=True, slots=True)
class Turn:
    new_tokens: list[int]  # appended to the session's history to make this turn's prompt
    output_tokens: int


@dataclass(slots=True)
class Session:
    turns: list[Turn]
    arrival_s: float | None = None  # trace workloads: when it starts, from the first arrival
    id: int = 0
    label: str = field(default="")


def random_workload(
    n: int, input_len: Lengths, output_len: Lengths, vocab_size: int, seed: int
) -> list[Session]:
    rng = random.Random(seed)
    return [
        Session([Turn(_tokens(rng, input_len.sample(rng), vocab_size), output_len.sample(rng))], id=i)
        for i in range(n)
    ]


def shared_prefix_workload(
    n: int, groups: int, prefix_len: int, input_len: Lengths, output_len: Lengths, vocab_size: int, seed: int
) -> list[Session]:
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in range(groups)]
    sessions = []
    for i in range(n):
        group = i % groups
        prompt = prefixes[group] + _tokens(rng, input_len.sample(rng), vocab_size)
        sessions.append(Session([Turn(prompt, output_len.sample(rng))], id=i, label=f"group-{group}"))
    rng.shuffle(sessions)  # groups interleaved, as real traffic is, but fixed by the seed
    return sessions


def multi_turn_workload(
    sessions: int, turns: int, input_len: Lengths, output_len: Lengths, vocab_size: int, seed: int
) -> list[Session]:
    rng = random.Random(seed)
    return [
        Session(
            [
                Turn(_tokens(rng, input_len.sample(rng), vocab_size), output_len.sample(rng))
                for _ in range(turns)
            ],
            id=i,
        )
        for i in range(sessions)
    ]


def trace_workload(
    path: str | Path, scale: int, vocab_size: int, max_requests: int | None, block_size: int = MOONCAKE_BLOCK
) -> list[Session]:
    """The trace's requests as one-turn sessions on their timestamps (seconds from the first).
    `block_size`: tokens per hash id in the trace (Mooncake's 512). Raises ValueError for a
    scale that does not divide it, or a trace with no valid line."""
    if scale < 1 or block_size % scale:
        raise ValueError(f"--scale must divide the trace's block size {block_size}; got {scale}")
    requests, errors = read_trace(path, block_size)
    if errors and not requests:
        raise ValueError(errors[0])
    requests = requests[:max_requests] if max_requests else requests
    if not requests:
        raise ValueError(f"{path}: no valid trace line")
    blocks = TraceTokens(block_size // scale, vocab_size)
    first = requests[0].timestamp_ms
    sessions = []
    for i, request in enumerate(requests):
        scaled = dataclasses.replace(request, input_length=max(1, request.input_length // scale))
        turn = Turn(blocks.prompt(scaled), request.output_length)
        sessions.append(Session([turn], arrival_s=(request.timestamp_ms - first) / 1e3, id=i))
    return sessions


def shifted(sessions: list[Session], run: int, vocab_size: int) -> list[Session]:
    """The same sessions with every token id moved by one per-run offset (mod the vocabulary):
    equal tokens stay equal, so lengths and prefix sharing are kept, but no run's prompts match
    another run's, and none is served from the cache an earlier run filled."""
    offset = run % vocab_size  # runs are numbered from 1, and there are far fewer than ids
    return [
        dataclasses.replace(
            s,
            turns=[
                Turn([(t + offset) % vocab_size for t in turn.new_tokens], turn.output_tokens)
                for turn in s.turns
            ],
        )
        for s in sessions
    ]


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]
