"""`weir bench`'s load driver against an in-process test double: closed-loop concurrency,
multi-turn histories, failed turns, Poisson and trace schedules. Nothing here is a server;
the double answers at once, so these test the scheduler."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
from typing import Any

import pytest

from orchestrator.bench.load import Load, run_load
from orchestrator.bench.targets import Clock, RequestRecord, Turn
from orchestrator.bench.workloads import Lengths, Session, multi_turn_workload, random_workload
from orchestrator.bench.workloads import Turn as WorkloadTurn

VOCAB = 1000


class InstantTarget:
    """Test double for a `Target`: records every turn it is sent and answers with one chunk per
    output token, timed on the run's clock. `hold` yields to the event loop that many times per
    request (no sleep), so concurrent sends overlap; `fail` names (session, turn)s that error;
    `reply_ids` False leaves `reply_ids` unset, as an HTTP server would."""

    name = "instant"

    def __init__(
        self, *, hold: int = 0, fail: frozenset[tuple[int, int]] = frozenset(), reply_ids: bool = True
    ) -> None:
        self.hold = hold
        self.fail = fail
        self.give_ids = reply_ids
        self.sent: list[Turn] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def reply(self, turn: Turn) -> list[int]:
        return [(500 + 10 * turn.session + turn.turn + k) % VOCAB for k in range(turn.output_tokens)]

    async def send(self, turn: Turn, clock: Clock) -> RequestRecord:
        self.sent.append(turn)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        record = RequestRecord(turn.session, turn.turn, clock.now(), len(turn.prompt_ids))
        try:
            for _ in range(self.hold):
                await asyncio.sleep(0)
            if (turn.session, turn.turn) in self.fail:
                record.error = "stream_error"
                return record
            ids = self.reply(turn)
            record.chunk_s = [clock.now() for _ in ids]
            record.end_s = clock.now()
            record.output_tokens = len(ids)
            record.reply_text = "reply " + " ".join(map(str, ids))
            record.reply_ids = ids if self.give_ids else None
            return record
        finally:
            self.in_flight -= 1

    async def describe(self) -> dict[str, Any]:
        return {"kind": "test-double"}

    async def close(self) -> None:
        pass


def _sessions(n: int, *, input_len: str = "4", output_len: str = "3", seed: int = 0) -> list[Session]:
    return random_workload(n, Lengths.parse(input_len), Lengths.parse(output_len), VOCAB, seed)


def _first_turn_starts(records: list[RequestRecord]) -> dict[int, float]:
    return {r.session: r.start_s for r in records if r.turn == 0}


def test_load_needs_a_schedule() -> None:
    with pytest.raises(ValueError, match="concurrency, a request rate or a trace"):
        Load()
    assert Load(concurrency=4).label == "concurrency 4"
    assert Load(rate=2.5, concurrency=8).label == "rate 2.5/s (max 8)"
    assert Load(trace_speedup=2).label == "trace x2"


@pytest.mark.parametrize("concurrency", [1, 3, 8])
async def test_closed_loop_caps_in_flight_and_sends_every_turn_once(concurrency: int) -> None:
    sessions = _sessions(40)
    target = InstantTarget(hold=5)
    seen: list[RequestRecord] = []
    records, duration = await run_load(
        sessions, target, Load(concurrency=concurrency), vocab_size=VOCAB, on_record=seen.append
    )
    assert target.max_in_flight == concurrency  # never more, and the concurrency is used
    assert sorted(t.session for t in target.sent) == list(range(40))
    assert [t.prompt_ids for t in sorted(target.sent, key=lambda t: t.session)] == [
        s.turns[0].new_tokens for s in sessions
    ]
    assert all(t.output_tokens == 3 for t in target.sent)
    assert len(records) == 40 and all(r.ok for r in records)
    assert seen == records
    assert duration == pytest.approx(max(r.end_s or 0 for r in records) - min(r.start_s for r in records))
    assert duration > 0


async def test_closed_loop_with_more_clients_than_sessions() -> None:
    target = InstantTarget(hold=2)
    records, _ = await run_load(_sessions(3), target, Load(concurrency=10), vocab_size=VOCAB)
    assert sorted(r.session for r in records) == [0, 1, 2]
    assert target.max_in_flight == 3


async def test_multi_turn_prompt_is_history_plus_reply_plus_new_tokens() -> None:
    sessions = multi_turn_workload(4, 3, Lengths.parse("5"), Lengths.parse("uniform:2,4"), VOCAB, seed=9)
    target = InstantTarget(hold=1)

    def decode(ids: list[int]) -> str:
        return ",".join(map(str, ids))

    records, _ = await run_load(sessions, target, Load(concurrency=2), vocab_size=VOCAB, decode=decode)
    assert len(records) == 12 and all(r.ok for r in records)
    for session in sessions:
        sent = [t for t in target.sent if t.session == session.id]
        assert [t.turn for t in sent] == [0, 1, 2]  # in order
        assert [t.output_tokens for t in sent] == [t.output_tokens for t in session.turns]
        prompt: list[int] = []
        messages: list[dict[str, str]] = []
        for i, (turn, new) in enumerate(zip(sent, session.turns, strict=True)):
            if i:
                reply = target.reply(sent[i - 1])
                prompt = prompt + reply
                messages = [*messages, {"role": "assistant", "content": decode(reply)}]
            prompt = prompt + new.new_tokens
            messages = [*messages, {"role": "user", "content": decode(new.new_tokens)}]
            assert turn.prompt_ids == prompt
            assert turn.messages == messages
        assert len(sent[2].messages) == 5
    # A later turn's history does not leak into a turn already sent (no shared mutable list).
    first = next(t for t in target.sent if t.session == 0 and t.turn == 0)
    assert first.prompt_ids == sessions[0].turns[0].new_tokens
    # Each turn's record comes after the previous one's.
    for s in range(4):
        mine = [r for r in records if r.session == s]
        assert all(a.end_s is not None and a.end_s <= b.start_s for a, b in itertools.pairwise(mine))


async def test_multi_turn_without_decode_sends_no_messages() -> None:
    sessions = multi_turn_workload(1, 2, Lengths.parse("3"), Lengths.parse("2"), VOCAB, seed=1)
    target = InstantTarget()
    await run_load(sessions, target, Load(concurrency=1), vocab_size=VOCAB)
    assert [t.messages for t in target.sent] == [[], []]
    assert len(target.sent[1].prompt_ids) == 3 + 2 + 3


async def test_multi_turn_reply_from_text_when_the_server_gives_no_ids() -> None:
    """An HTTP server's reply is re-tokenized with `encode`; with no tokenizer it becomes as many
    seeded ids, below the vocabulary, as the server reported tokens."""
    sessions = multi_turn_workload(2, 2, Lengths.parse("3"), Lengths.parse("4"), VOCAB, seed=1)

    def encode(text: str) -> list[int]:
        return [len(word) for word in text.split()]

    target = InstantTarget(reply_ids=False)
    await run_load(sessions, target, Load(concurrency=1), vocab_size=VOCAB, encode=encode)
    for s in sessions:
        first, second = (t for t in target.sent if t.session == s.id)
        reply = encode("reply " + " ".join(map(str, target.reply(first))))
        assert second.prompt_ids == first.prompt_ids + reply + s.turns[1].new_tokens

    runs = []
    for _ in range(2):
        target = InstantTarget(reply_ids=False)
        await run_load(sessions, target, Load(concurrency=1, seed=3), vocab_size=VOCAB)
        runs.append(target)
    for s in sessions:
        first, second = (t for t in runs[0].sent if t.session == s.id)
        filler = second.prompt_ids[3:-3]
        assert len(filler) == 4 and all(0 <= t < VOCAB for t in filler)
        assert second.prompt_ids[:3] == first.prompt_ids and second.prompt_ids[-3:] == s.turns[1].new_tokens
    assert [t.prompt_ids for t in runs[0].sent] == [t.prompt_ids for t in runs[1].sent]  # seeded


async def test_a_failed_turn_ends_its_session() -> None:
    sessions = multi_turn_workload(3, 3, Lengths.parse("2"), Lengths.parse("2"), VOCAB, seed=4)
    target = InstantTarget(fail=frozenset({(1, 1)}))
    records, _ = await run_load(sessions, target, Load(concurrency=3), vocab_size=VOCAB)
    sent = sorted((t.session, t.turn) for t in target.sent)
    assert sent == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    failed = [r for r in records if not r.ok]
    assert [(r.session, r.turn, r.error) for r in failed] == [(1, 1, "stream_error")]  # kept, counted
    assert len(records) == 8


async def test_poisson_gaps_average_one_over_the_rate() -> None:
    rate, n = 1000.0, 300
    target = InstantTarget()
    records, _ = await run_load(_sessions(n), target, Load(rate=rate, seed=5), vocab_size=VOCAB)
    starts = sorted(_first_turn_starts(records).values())
    assert len(starts) == n
    mean_gap = (starts[-1] - starts[0]) / (n - 1)
    assert 0.7 / rate < mean_gap < 1.4 / rate
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # Exponential, not evenly spaced: many gaps well under the mean, some well over.
    assert sum(g < 0.5 / rate for g in gaps) > n // 5
    assert sum(g > 2 / rate for g in gaps) > n // 20
    assert statistics.pstdev(gaps) > 0.5 / rate


async def test_poisson_schedule_follows_the_seed() -> None:
    """Sessions start at the seed's exponential gaps (the first at once), in order, never early:
    the same seed gives the same schedule, another seed another one."""
    rate, n = 200.0, 25

    def schedule(seed: int) -> list[float]:
        rng, at, times = random.Random(seed), 0.0, [0.0]
        for _ in range(n - 1):
            at += rng.expovariate(rate)
            times.append(at)
        return times

    for seed in (11, 11, 12):
        records, _ = await run_load(
            _sessions(n), InstantTarget(), Load(rate=rate, seed=seed), vocab_size=VOCAB
        )
        starts = _first_turn_starts(records)
        expected = schedule(seed)
        lateness = [starts[i] - expected[i] for i in range(n)]
        assert min(lateness) > -1e-4, seed  # none starts before its time
        assert statistics.median(lateness) < 0.02, seed  # and they follow this seed's times
    other = schedule(12)
    assert max(abs(a - b) for a, b in zip(schedule(11), other, strict=True)) > 0.02  # seeds differ


async def test_poisson_concurrency_caps_in_flight() -> None:
    target = InstantTarget(hold=5)
    records, _ = await run_load(_sessions(30), target, Load(rate=1e6, concurrency=2), vocab_size=VOCAB)
    assert len(records) == 30
    assert target.max_in_flight == 2
    uncapped = InstantTarget(hold=5)
    await run_load(_sessions(30), uncapped, Load(rate=1e6), vocab_size=VOCAB)
    assert uncapped.max_in_flight > 2  # open loop: sessions do not wait for each other


async def test_trace_schedule_starts_no_session_before_its_arrival() -> None:
    arrivals = [0.0, 0.02, 0.05, 0.05, 0.11, 0.2]
    sessions = [
        Session([WorkloadTurn([i + 1, i + 2], 2)], arrival_s=at, id=i) for i, at in enumerate(arrivals)
    ]
    target = InstantTarget()
    records, _ = await run_load(sessions, target, Load(trace_speedup=2), vocab_size=VOCAB)
    starts = _first_turn_starts(records)
    assert sorted(starts) == list(range(len(arrivals)))
    for i, at in enumerate(arrivals):
        assert starts[i] >= at / 2 - 1e-4, (i, starts[i])
    assert starts[5] < 0.2  # sped up: the last arrival, at 0.2 s of trace time, came at ~0.1 s
    assert [t.session for t in target.sent] == list(range(len(arrivals)))  # in arrival order
