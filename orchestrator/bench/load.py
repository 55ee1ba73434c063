"""How sessions are started: closed loop, open loop (Poisson), or on a trace's timestamps.

- closed loop (`concurrency`): that many sessions in flight, the next starting as one ends.
- Poisson (`rate`): sessions start at exponentially distributed gaps (seeded), whatever the
  server's state; `concurrency` then caps how many are in flight (vLLM's --max-concurrency).
- trace: each session starts at its `arrival_s` divided by `trace_speedup`.

A session's turns run in order, each prompt being the history so far: earlier prompts, each
reply (a worker's exact ids; from an HTTP server the reply text re-tokenized, or as many
seeded ids as it had tokens when there is no tokenizer) and the turn's new tokens. A failed
turn ends its session, since the next turn's prompt would need its reply.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.bench.targets import Clock, RequestRecord, Target, Turn
from orchestrator.bench.workloads import Session

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


@dataclass(frozen=True, slots=True)
class Load:
    concurrency: int | None = None
    rate: float | None = None
    trace_speedup: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency is None and self.rate is None and self.trace_speedup is None:
            raise ValueError("a load needs a concurrency, a request rate or a trace schedule")

    @property
    def label(self) -> str:
        if self.trace_speedup is not None:
            return f"trace x{self.trace_speedup:g}"
        if self.rate is not None:
            cap = f" (max {self.concurrency})" if self.concurrency else ""
            return f"rate {self.rate:g}/s{cap}"
        return f"concurrency {self.concurrency}"


class _Conversation:
    def __init__(self, vocab_size: int, encode: Encode | None, decode: Decode | None, seed: int) -> None:
        self.ids: list[int] = []
        self.messages: list[dict[str, str]] = []
        self.vocab_size = vocab_size
        self.encode = encode
        self.decode = decode
        self.rng = random.Random(seed)

    def ask(self, session: int, index: int, new_tokens: list[int], output_tokens: int) -> Turn:
        self.ids = self.ids + new_tokens
        if self.decode is not None:
            self.messages = [*self.messages, {"role": "user", "content": self.decode(new_tokens)}]
        return Turn(session, index, self.ids, self.messages, output_tokens)

    def answered(self, record: RequestRecord) -> None:
        if record.reply_ids is not None:
            reply = record.reply_ids
        elif self.encode is not None:
            reply = self.encode(record.reply_text)
        else:
            reply = [self.rng.randrange(self.vocab_size) for _ in range(record.output_tokens)]
        self.ids = self.ids + reply
        if self.decode is not None:
            text = record.reply_text if record.reply_ids is None else self.decode(reply)
            self.messages = [*self.messages, {"role": "assistant", "content": text}]


async def run_load(
    sessions: list[Session],
    target: Target,
    load: Load,
    *,
    vocab_size: int,
    encode: Encode | None = None,
    decode: Decode | None = None,
    on_record: Callable[[RequestRecord], None] = lambda _: None,
) -> tuple[list[RequestRecord], float]:
    """Every turn's record, and the run's duration in seconds (first send to last finish)."""
    clock = Clock()
    records: list[RequestRecord] = []
    slots = asyncio.Semaphore(load.concurrency) if load.concurrency else None

    async def run_session(session: Session) -> None:
        conversation = _Conversation(vocab_size, encode, decode, seed=load.seed * 1_000_003 + session.id)
        for index, turn in enumerate(session.turns):
            record = await target.send(
                conversation.ask(session.id, index, turn.new_tokens, turn.output_tokens), clock
            )
            records.append(record)
            on_record(record)
            if not record.ok:
                return
            conversation.answered(record)

    async def limited(session: Session) -> None:
        if slots is None:
            await run_session(session)
            return
        async with slots:
            await run_session(session)

    tasks: list[asyncio.Task[None]] = []
    if load.trace_speedup is None and load.rate is None:
        queue = iter(sessions)

        async def closed_loop_client() -> None:
            for session in queue:  # one shared iterator: each session is taken once
                await run_session(session)

        assert load.concurrency is not None
        tasks = [asyncio.create_task(closed_loop_client()) for _ in range(load.concurrency)]
    else:
        rng = random.Random(load.seed)
        at = 0.0
        for session in sessions:
            if load.trace_speedup is not None:
                at = (session.arrival_s or 0.0) / load.trace_speedup
            elif tasks:
                assert load.rate is not None
                at += rng.expovariate(load.rate)
            delay = at - clock.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(session)))
    await asyncio.gather(*tasks)
    ends = [r.end_s for r in records if r.end_s is not None]
    starts = [r.start_s for r in records]
    duration = (max(ends) - min(starts)) if ends and starts else 0.0
    return records, duration
