"""Request migration on DeepInfer: a request resumed after N tokens (`generated_token_ids`)
continues exactly as the uninterrupted one, greedy or seeded, with penalties, logprobs,
limits, usage and a grammar all counting the tokens generated before."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from backends.deepinfer.config import EngineConfig
from backends.deepinfer.engine import Engine
from backends.deepinfer.outputs import SeqOutput
from orchestrator.runtime.protocol import GuidedSpec, SamplingOptions, WorkerRequest
from tests.deepinfer.device import DEVICE, DTYPE

CUT = 7


def make_engine(model_dir: Path) -> Engine:
    return Engine(
        EngineConfig(model=str(model_dir), device=DEVICE, dtype=DTYPE, num_kv_blocks=128, block_size=16)
    )


def run(engine: Engine, req: WorkerRequest) -> tuple[list[int], list[float], SeqOutput]:
    """A request's new tokens, their logprobs, and its final output."""
    engine.add(req)
    tokens: list[int] = []
    logprobs: list[float] = []
    final: SeqOutput | None = None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += [t.token_id for t in o.new_tokens]
            logprobs += [t.logprob for t in o.new_tokens if t.logprob is not None]
            if o.finished:
                final = o
    assert final is not None
    return tokens, logprobs, final


SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"sampling": SamplingOptions(temperature=0.0)},
    "seeded": {"sampling": SamplingOptions(temperature=1.0, top_p=0.95, seed=1234)},
    "penalties": {
        "sampling": SamplingOptions(
            temperature=0.7, seed=5, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3
        )
    },
    "min_tokens": {"sampling": SamplingOptions(temperature=0.0), "min_tokens": 16, "ignore_eos": False},
}


@pytest.mark.parametrize("kind", list(SAMPLINGS))
def test_resumed_after_n_tokens_equals_uninterrupted(tiny_llama_dir: Path, kind: str) -> None:
    engine = make_engine(tiny_llama_dir)
    prompt = [random.Random(kind).randrange(3, 500) for _ in range(37)]
    fields = {"ignore_eos": True, "logprobs": 0, **SAMPLINGS[kind]}
    whole, whole_lp, whole_final = run(
        engine, WorkerRequest(request_id="a", token_ids=prompt, max_tokens=24, **fields)
    )
    assert len(whole) > CUT
    # A fresh engine, as another worker would be: nothing cached, no sampler state.
    rest, rest_lp, final = run(
        make_engine(tiny_llama_dir),
        WorkerRequest(
            request_id="a", token_ids=prompt, max_tokens=24, generated_token_ids=whole[:CUT], **fields
        ),
    )
    assert whole[:CUT] + rest == whole
    assert rest_lp == pytest.approx(whole_lp[CUT:], abs=1e-4)
    assert final.seq.finish_reason == whole_final.seq.finish_reason
    assert final.seq.num_prompt_tokens == len(prompt)
    assert final.seq.num_completion_tokens == len(whole)  # usage counts the earlier tokens
    if kind == "seeded":
        assert len(set(whole)) > 3  # it sampled, not a degenerate repeat


def test_a_resumed_grammar_continues_from_its_state(tiny_llama_dir: Path) -> None:
    spec = GuidedSpec(kind="choice", value=["alpha beta gamma delta", "alphabet soup"])
    fields: dict[str, Any] = {"sampling": SamplingOptions(temperature=0.0), "guided": spec}
    prompt = [random.Random(9).randrange(3, 500) for _ in range(12)]
    whole, _, _ = run(
        make_engine(tiny_llama_dir), WorkerRequest(request_id="g", token_ids=prompt, max_tokens=40, **fields)
    )
    cut = len(whole) // 2
    assert cut > 0
    engine = make_engine(tiny_llama_dir)
    rest, _, _ = run(
        engine,
        WorkerRequest(
            request_id="g", token_ids=prompt, max_tokens=40, generated_token_ids=whole[:cut], **fields
        ),
    )
    assert whole[:cut] + rest == whole
    # Tokens the grammar cannot have produced (EOS before any choice) are refused, nothing queued.
    eos = engine.eos_token_ids[0]
    bad = WorkerRequest(request_id="b", token_ids=prompt, max_tokens=40, generated_token_ids=[eos], **fields)
    with pytest.raises(ValueError, match="do not match the request's constraint"):
        engine.add(bad)
    assert not engine.has_unfinished()


def test_nothing_left_to_generate_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="nothing is left to generate"):
        make_engine(tiny_llama_dir).add(
            WorkerRequest(request_id="x", token_ids=[5, 6], max_tokens=3, generated_token_ids=[7, 8, 9])
        )
