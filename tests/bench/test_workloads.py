"""`weir bench` workloads: length specs, the synthetic generators, Mooncake traces at a scale,
and the per-run id shift that keeps every length and every shared prefix."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from orchestrator.bench.workloads import (
    Lengths,
    Session,
    Turn,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
    shifted,
    trace_workload,
)

VOCAB = 50_000


def _prompts(sessions: list[Session]) -> list[list[int]]:
    return [turn.new_tokens for s in sessions for turn in s.turns]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------------------- Lengths


def test_lengths_parse_fixed() -> None:
    length = Lengths.parse("128")
    assert (length.kind, length.a) == ("fixed", 128)
    rng = random.Random(0)
    assert {length.sample(rng) for _ in range(20)} == {128}
    assert str(length) == "128"


def test_lengths_parse_uniform_samples_within_bounds() -> None:
    length = Lengths.parse("uniform:5,9")
    assert (length.kind, length.a, length.b) == ("uniform", 5, 9)
    rng = random.Random(1)
    samples = [length.sample(rng) for _ in range(500)]
    assert set(samples) == {5, 6, 7, 8, 9}  # both bounds inclusive, nothing outside
    assert str(length) == "uniform:5,9"
    assert Lengths.parse("uniform:3,3").sample(rng) == 3


def test_lengths_parse_normal_never_below_one() -> None:
    length = Lengths.parse("normal:2,50")
    assert (length.kind, length.a, length.b) == ("normal", 2, 50)
    rng = random.Random(2)
    samples = [length.sample(rng) for _ in range(2000)]
    assert min(samples) == 1  # a wide spread would go far below zero: clamped at 1
    assert max(samples) > 50
    assert all(isinstance(s, int) for s in samples)
    tight = Lengths.parse("normal:100,0")
    assert {tight.sample(rng) for _ in range(10)} == {100}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("abc", "expected N, uniform:MIN,MAX or normal:MEAN,STD"),
        ("", "expected N"),
        ("0", "'0'"),
        ("-3", "'-3'"),
        ("12.5", "expected N"),
        ("uniform:64", "expected N, uniform:MIN,MAX"),
        ("uniform:a,b", "expected N, uniform:MIN,MAX"),
        ("uniform:1,2,3", "expected N, uniform:MIN,MAX"),
        ("uniform:9,5", "1 <= MIN <= MAX"),
        ("uniform:0,5", "1 <= MIN <= MAX"),
        ("normal:0,5", "normal:MEAN,STD"),
        ("normal:10,-1", "normal:MEAN,STD"),
        ("poisson:3,4", "expected N, uniform:MIN,MAX"),
        ("0", "a length must be at least 1"),
        ("uniform:1.5,2.5", "whole 1 <= MIN <= MAX"),  # would sample below MIN
        ("uniform:1,inf", "whole 1 <= MIN <= MAX"),
        ("normal:inf,1", "normal:MEAN,STD"),
        ("normal:nan,1", "normal:MEAN,STD"),
    ],
)
def test_lengths_parse_rejects_bad_input(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        Lengths.parse(text)
    assert message in str(info.value)
    assert repr(text) in str(info.value)  # the message names what was given


# ---------------------------------------------------------------------------- generators


def test_random_workload_is_deterministic_per_seed() -> None:
    inputs, outputs = Lengths.parse("uniform:4,40"), Lengths.parse("uniform:1,9")
    a = random_workload(20, inputs, outputs, VOCAB, seed=7)
    b = random_workload(20, inputs, outputs, VOCAB, seed=7)
    c = random_workload(20, inputs, outputs, VOCAB, seed=8)
    assert a == b
    assert _prompts(a) != _prompts(c)
    assert [s.id for s in a] == list(range(20))
    assert len({len(p) for p in _prompts(a)}) > 1  # lengths really drawn


def test_random_workload_exact_fixed_lengths_below_vocab() -> None:
    sessions = random_workload(30, Lengths.parse("17"), Lengths.parse("5"), vocab_size=11, seed=3)
    assert len(sessions) == 30
    for s in sessions:
        assert len(s.turns) == 1 and s.arrival_s is None
        (turn,) = s.turns
        assert len(turn.new_tokens) == 17
        assert turn.output_tokens == 5
        assert all(0 <= t < 11 for t in turn.new_tokens)
    # A small vocabulary is used in full, not just a corner of it.
    assert {t for p in _prompts(sessions) for t in p} == set(range(11))


def test_shared_prefix_workload_groups_share_their_prefix() -> None:
    prefix_len, groups = 32, 3
    sessions = shared_prefix_workload(
        12, groups, prefix_len, Lengths.parse("8"), Lengths.parse("4"), VOCAB, seed=5
    )
    assert sorted(s.id for s in sessions) == list(range(12))
    by_group: dict[str, list[list[int]]] = {}
    for s in sessions:
        (turn,) = s.turns
        assert s.label == f"group-{s.id % groups}"
        assert len(turn.new_tokens) == prefix_len + 8  # suffix exactly input_len
        assert turn.output_tokens == 4
        assert all(0 <= t < VOCAB for t in turn.new_tokens)
        by_group.setdefault(s.label, []).append(turn.new_tokens)
    assert sorted(by_group) == ["group-0", "group-1", "group-2"]
    prefixes = {}
    for label, prompts in by_group.items():
        assert len(prompts) == 4
        first = prompts[0][:prefix_len]
        assert all(p[:prefix_len] == first for p in prompts)
        assert len({tuple(p[prefix_len:]) for p in prompts}) == len(prompts)  # own suffixes
        prefixes[label] = tuple(first)
    assert len(set(prefixes.values())) == groups  # groups differ
    # Interleaved by the shuffle, but the same seed gives the same order.
    again = shared_prefix_workload(12, groups, prefix_len, Lengths.parse("8"), Lengths.parse("4"), VOCAB, 5)
    assert again == sessions
    assert [s.id for s in sessions] != list(range(12))


def test_multi_turn_workload_has_the_requested_turns() -> None:
    sessions = multi_turn_workload(5, 3, Lengths.parse("6"), Lengths.parse("uniform:2,4"), VOCAB, seed=1)
    assert [s.id for s in sessions] == list(range(5))
    for s in sessions:
        assert len(s.turns) == 3
        assert all(len(t.new_tokens) == 6 for t in s.turns)
        assert all(2 <= t.output_tokens <= 4 for t in s.turns)
        assert len({tuple(t.new_tokens) for t in s.turns}) == 3  # each turn has its own message
    assert multi_turn_workload(5, 3, Lengths.parse("6"), Lengths.parse("uniform:2,4"), VOCAB, 1) == sessions


# ---------------------------------------------------------------------------- traces

# Hash ids: 0 and 1 share the first two blocks; 1 and 2 share one; 3 shares nothing.
TRACE = [
    {"timestamp": 1000, "input_length": 1536, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 1250, "input_length": 1500, "output_length": 20, "hash_ids": [1, 2, 4]},
    {"timestamp": 3000, "input_length": 1100, "output_length": 30, "hash_ids": [1, 5, 6]},
    {"timestamp": 4500, "input_length": 600, "output_length": 40, "hash_ids": [7, 8]},
]


def _write_trace(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("scale", [1, 4, 16])
def test_trace_workload_scales_lengths_and_keeps_sharing(tmp_path: Path, scale: int) -> None:
    trace = _write_trace(tmp_path / "trace.jsonl", TRACE)
    sessions = trace_workload(trace, scale, VOCAB, max_requests=None)
    assert [s.id for s in sessions] == [0, 1, 2, 3]
    assert [s.arrival_s for s in sessions] == pytest.approx([0.0, 0.25, 2.0, 3.5])
    prompts = [s.turns[0].new_tokens for s in sessions]
    assert [len(p) for p in prompts] == [line["input_length"] // scale for line in TRACE]
    assert [s.turns[0].output_tokens for s in sessions] == [10, 20, 30, 40]  # not scaled
    assert all(0 <= t < VOCAB for p in prompts for t in p)
    block = 512 // scale
    for i, a in enumerate(TRACE):
        for j, b in enumerate(TRACE):
            if i == j:
                continue
            shared = _common_prefix(list(a["hash_ids"]), list(b["hash_ids"]))
            # Exactly `shared` blocks of 512/k tokens in common, and different right after.
            assert _common_prefix(prompts[i], prompts[j]) == shared * block, (i, j)


def test_trace_workload_blocks_are_the_same_tokens_at_any_position(tmp_path: Path) -> None:
    """Equal hash ids name equal blocks: a block seen at a different position (or behind a
    different prefix) is still the same tokens."""
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [10, 11]},
        {"timestamp": 5, "input_length": 1024, "output_length": 1, "hash_ids": [12, 11]},
    ]
    a, b = (
        s.turns[0].new_tokens for s in trace_workload(_write_trace(tmp_path / "t", lines), 4, VOCAB, None)
    )
    assert a[:128] != b[:128]
    assert a[128:] == b[128:]


def test_trace_workload_orders_by_timestamp_and_honours_max_requests(tmp_path: Path) -> None:
    shuffled = [TRACE[2], TRACE[0], TRACE[3], TRACE[1]]
    sessions = trace_workload(_write_trace(tmp_path / "t.jsonl", shuffled), 1, VOCAB, max_requests=None)
    assert [s.arrival_s for s in sessions] == pytest.approx([0.0, 0.25, 2.0, 3.5])
    assert [s.turns[0].output_tokens for s in sessions] == [10, 20, 30, 40]
    two = trace_workload(_write_trace(tmp_path / "t.jsonl", TRACE), 1, VOCAB, max_requests=2)
    assert [s.turns[0].output_tokens for s in two] == [10, 20]


@pytest.mark.parametrize("scale", [0, 3, 5, 1024, -2])
def test_trace_workload_rejects_a_scale_not_dividing_512(tmp_path: Path, scale: int) -> None:
    trace = _write_trace(tmp_path / "trace.jsonl", TRACE)
    with pytest.raises(ValueError, match=f"must divide the trace.s block size 512; got {scale}"):
        trace_workload(trace, scale, VOCAB, None)


def test_trace_workload_with_no_valid_line_raises(tmp_path: Path) -> None:
    bad = [{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1]}]  # needs 2
    with pytest.raises(ValueError, match="hash_ids"):
        trace_workload(_write_trace(tmp_path / "bad.jsonl", bad), 1, VOCAB, None)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no valid trace line"):
        trace_workload(tmp_path / "empty.jsonl", 1, VOCAB, None)


# ---------------------------------------------------------------------------- shifted


def _positions_equal(a: list[int], b: list[int]) -> list[bool]:
    return [x == y for x, y in zip(a, b, strict=False)]


def test_shifted_keeps_lengths_and_sharing_but_changes_ids() -> None:
    vocab = 1000
    base = shared_prefix_workload(6, 2, 16, Lengths.parse("uniform:4,9"), Lengths.parse("3"), vocab, seed=2)
    base += multi_turn_workload(2, 3, Lengths.parse("5"), Lengths.parse("2"), vocab, seed=3)
    runs = {run: shifted(base, run, vocab) for run in (1, 2, 3)}
    for moved in runs.values():
        assert [s.id for s in moved] == [s.id for s in base]
        assert [s.label for s in moved] == [s.label for s in base]
        assert [[t.output_tokens for t in s.turns] for s in moved] == [
            [t.output_tokens for t in s.turns] for s in base
        ]
        old, new = _prompts(base), _prompts(moved)
        assert [len(p) for p in new] == [len(p) for p in old]
        assert all(0 <= t < vocab for p in new for t in p)
        for a, b in zip(old, new, strict=True):
            assert all(x != y for x, y in zip(a, b, strict=True))  # every id moved
        # Equal token positions stay equal between any two prompts (shared prefixes kept).
        for i in range(len(old)):
            for j in range(i + 1, len(old)):
                assert _positions_equal(new[i], new[j]) == _positions_equal(old[i], old[j])
    assert _prompts(runs[1]) != _prompts(runs[2])
    assert _prompts(runs[3]) != _prompts(runs[1])
    assert base == shared_prefix_workload(
        6, 2, 16, Lengths.parse("uniform:4,9"), Lengths.parse("3"), vocab, seed=2
    ) + multi_turn_workload(2, 3, Lengths.parse("5"), Lengths.parse("2"), vocab, seed=3)  # not mutated


def test_shifted_runs_differ_whatever_the_vocabulary_size() -> None:
    sessions = [Session([Turn([1, 2, 3], 1)])]
    for vocab in (7919, 32000, 49152):  # 7919: the old offset's multiplier made runs collide
        ids = [shifted(sessions, run, vocab)[0].turns[0].new_tokens for run in range(1, 50)]
        assert len({tuple(i) for i in ids}) == len(ids), vocab


def test_shifted_ids_stay_below_vocab_at_the_top() -> None:
    vocab = 10
    sessions = [Session([Turn([9, 8, 0], 1)])]
    moved = shifted(sessions, 1, vocab)
    ids = moved[0].turns[0].new_tokens
    assert all(0 <= t < vocab for t in ids)
    assert ids != [9, 8, 0]
    assert (ids[0] - ids[1]) % vocab == 1 and (ids[2] - ids[1]) % vocab == 2
