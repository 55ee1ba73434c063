"""Speculative decoding by n-gram prompt lookup: the proposer on its own, then the engine
on tiny random models, whose greedy output soon repeats itself (so drafts are accepted),
against the same engine without speculation: the same tokens, finish reasons and logprobs,
for greedy and for seeded sampling with penalties, under preemption, stop tokens and the
context limit."""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import pytest

from backends.deepinfer.args import speculative_config
from backends.deepinfer.engine import Engine
from backends.deepinfer.ngram import NgramProposer
from backends.deepinfer.outputs import SeqOutput
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest
from tests.deepinfer.test_engine import generated, make_engine, prompt, run
from tests.deepinfer.test_engine import request as make_request

SPEC = {"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
INVERTED_LOOKUP = (
    '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}'
)


# ---------------------------------------------------------------------------- the proposer


def test_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    proposer = NgramProposer(k=3, min_n=2, max_n=4)
    # Suffix [1, 2] occurs at 0 (followed by 3, 4, 5) and at 5 (followed by 9, 8, 1).
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 9, 8, 1, 2], limit=10) == [9, 8, 1]
    # The longer suffix [7, 1, 2] wins over the later [1, 2].
    assert proposer.propose([7, 1, 2, 6, 6, 1, 2, 5, 7, 1, 2], limit=10) == [6, 6, 1]


def test_proposes_nothing_without_a_recurring_suffix_of_min_n() -> None:
    proposer = NgramProposer(k=3, min_n=2, max_n=3)
    assert proposer.propose([1, 2, 3, 4], limit=10) == []
    assert proposer.propose([5, 1, 6, 1], limit=10) == []  # only the 1-gram [1] recurs
    assert NgramProposer(k=3, min_n=1, max_n=3).propose([5, 1, 6, 1], limit=10) == [6, 1]
    assert proposer.propose([1], limit=10) == []


def test_proposals_stop_at_k_the_limit_and_the_end_of_the_sequence() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert NgramProposer(k=5, min_n=2, max_n=2).propose(tokens, limit=10) == [3, 4, 5, 6, 1]
    assert NgramProposer(k=5, min_n=2, max_n=2).propose(tokens, limit=2) == [3, 4]
    assert NgramProposer(k=5, min_n=2, max_n=2).propose(tokens, limit=0) == []
    # [1, 1] recurs one token back: what follows is only the sequence's own last token.
    assert NgramProposer(k=4, min_n=2, max_n=2).propose([1, 1, 1], limit=10) == [1]


def test_speculative_config_takes_vllms_ngram_and_mtp_json() -> None:
    assert speculative_config('{"method": "ngram", "num_speculative_tokens": 3}') == {
        "speculative_method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    assert speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 1}') == {
        "speculative_method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 1,
        "prompt_lookup_min": 1,
    }
    mtp = {"speculative_method": "mtp", "num_speculative_tokens": 1}
    assert speculative_config('{"method": "mtp"}') == mtp
    assert speculative_config('{"method": "deepseek_mtp", "num_speculative_tokens": 1}') == mtp
    chained = {**mtp, "num_speculative_tokens": 3}
    assert speculative_config('{"method": "mtp", "num_speculative_tokens": 3}') == chained
    for bad, message in (
        ('{"method": "eagle", "num_speculative_tokens": 3}', "not supported"),
        ('{"method": "mtp", "prompt_lookup_max": 3}', "unknown fields"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "positive integers"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', "unknown fields"),
        (INVERTED_LOOKUP, "exceed"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            speculative_config(bad)


# ---------------------------------------------------------------------------- the engine


def requests(count: int = 4, max_tokens: int = 64, **fields: Any) -> list[WorkerRequest]:
    return [make_request(f"r{i}", prompt(random.Random(i), 24), max_tokens, **fields) for i in range(count)]


def with_and_without(
    model_dir: Path, reqs: list[WorkerRequest], **config: Any
) -> tuple[dict[str, SeqOutput], dict[str, SeqOutput], Engine]:
    plain = run(make_engine(model_dir, **config), reqs)
    engine = make_engine(model_dir, **config, **SPEC)
    spec = run(engine, reqs)
    return plain, spec, engine


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_deepseek_dir"])
def test_greedy_output_is_the_same_with_drafts_accepted(model: str, request: pytest.FixtureRequest) -> None:
    plain, spec, engine = with_and_without(request.getfixturevalue(model), requests())
    assert generated(spec) == generated(plain)
    assert {k: o.seq.finish_reason for k, o in spec.items()} == {k: "length" for k in plain}
    scheduler = engine.scheduler
    assert scheduler.num_draft_tokens > 0
    assert 0 < scheduler.num_accepted_tokens <= scheduler.num_draft_tokens


def test_seeded_sampling_with_penalties_and_logprobs_is_the_same(tiny_llama_dir: Path) -> None:
    sampling = SamplingOptions(
        temperature=0.7, top_p=0.95, seed=11, repetition_penalty=1.1, frequency_penalty=0.2
    )
    reqs = requests(sampling=sampling, min_tokens=20, logprobs=2)
    plain, spec, engine = with_and_without(tiny_llama_dir, reqs)
    assert generated(spec) == generated(plain)
    assert engine.scheduler.num_accepted_tokens > 0


def test_logprobs_of_accepted_drafts_match_plain_decoding(tiny_llama_dir: Path) -> None:
    reqs = requests(count=2, logprobs=3)
    outputs: list[dict[str, list[tuple[int, float]]]] = []
    for config in ({}, SPEC):
        engine = make_engine(tiny_llama_dir, **config)
        for r in reqs:
            engine.add(r)
        steps: dict[str, list[tuple[int, float]]] = {r.request_id: [] for r in reqs}
        while engine.has_unfinished():
            for o in engine.step():
                steps[o.seq.request_id] += [(t.token_id, t.logprob or 0.0) for t in o.new_tokens]
        outputs.append(steps)
    plain, spec = outputs
    for rid, tokens in plain.items():
        assert [t for t, _ in spec[rid]] == [t for t, _ in tokens]
        assert [lp for _, lp in spec[rid]] == pytest.approx([lp for _, lp in tokens], abs=1e-4)


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there(tiny_llama_dir: Path) -> None:
    first = generated(run(make_engine(tiny_llama_dir), requests(count=1)))["r0"]
    # A token the output repeats, so speculation has drafted it by its second occurrence.
    stop = next(t for i, t in enumerate(first) if t in first[:i] and i > 8)
    base = requests(count=1)[0]
    stopping = WorkerRequest(
        request_id="s", token_ids=base.token_ids, max_tokens=64, sampling=base.sampling, stop_token_ids=[stop]
    )
    plain, spec, _ = with_and_without(tiny_llama_dir, [stopping])
    assert generated(spec) == generated(plain)
    assert spec["s"].seq.finish_reason == "stop" and generated(spec)["s"][-1] == stop


def test_max_tokens_and_the_context_limit_hold_exactly(tiny_llama_dir: Path) -> None:
    reqs = [make_request(f"m{n}", prompt(random.Random(n), 24), n) for n in (1, 2, 5, 33)]
    plain, spec, _ = with_and_without(tiny_llama_dir, reqs)
    assert generated(spec) == generated(plain)
    assert [len(generated(spec)[f"m{n}"]) for n in (1, 2, 5, 33)] == [1, 2, 5, 33]
    # A context limit 30 tokens past the prompt: the last draft may not cross it.
    limited = requests(count=2, max_tokens=200)
    plain, spec, _ = with_and_without(tiny_llama_dir, limited, max_model_len=54)
    assert generated(spec) == generated(plain)
    assert all(len(o.seq.token_ids) == 54 and o.seq.finish_reason == "length" for o in spec.values())


def test_preemption_and_prefix_caching_under_speculation(tiny_llama_dir: Path) -> None:
    # 12 blocks of 8 tokens for 6 requests that each reach 88 tokens: most are preempted and
    # recomputed, several times, partly from the prefix cache.
    reqs = requests(count=6, max_tokens=64)
    plain, spec, engine = with_and_without(tiny_llama_dir, reqs, block_size=8, num_kv_blocks=12)
    assert generated(spec) == generated(plain)
    assert engine.num_preemptions > 0 and engine.scheduler.num_accepted_tokens > 0
