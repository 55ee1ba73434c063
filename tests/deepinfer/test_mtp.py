"""Speculative decoding with DeepSeek-V3's multi-token-prediction (MTP) layer, on tiny
checkpoints: one whose MTP layer is built to predict well (`build_mtp_checkpoint`), so drafts
are accepted, and one with random MTP weights; one draft per step, and three (the layer
chained). Output must be what decoding without drafts gives, and each draft what the MTP
layer predicts from the whole sequence at once."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from backends.deepinfer.config import EngineConfig
from backends.deepinfer.engine import Engine
from backends.deepinfer.outputs import ScheduledChunk, SchedulerOutput, SeqOutput
from backends.deepinfer.tiny import build_checkpoint, build_mtp_checkpoint
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest
from tests.deepinfer.test_engine import generated, make_engine, prompt, run
from tests.deepinfer.test_engine import request as make_request
from tests.deepinfer.test_models import Blocks, make_runner, make_seqs

MTP = {"speculative_method": "mtp", "num_speculative_tokens": 1}
CHAINED = {"speculative_method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mtp_checkpoint(tmp_path_factory.mktemp("tiny-deepseek-mtp"))


@pytest.fixture(scope="module")
def mtp_hidden_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MTP layer that reads the main model's hidden state too: about half its drafts hold."""
    return build_mtp_checkpoint(tmp_path_factory.mktemp("tiny-deepseek-mtp-hidden"), hidden_weight=0.3)


@pytest.fixture(scope="module")
def random_mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three-layer tiny DeepSeek-V3 (a dense layer, then MoE) with a random MTP layer."""
    model_dir = tmp_path_factory.mktemp("tiny-deepseek-random-mtp")
    return build_checkpoint(model_dir, "deepseek_v3", num_nextn_predict_layers=1)


def requests(count: int = 4, max_tokens: int = 48, **fields: Any) -> list[WorkerRequest]:
    return [make_request(f"r{i}", prompt(random.Random(i), 24), max_tokens, **fields) for i in range(count)]


def with_and_without(
    model_dir: Path, reqs: list[WorkerRequest], spec: dict[str, Any] = MTP, **config: Any
) -> tuple[dict[str, SeqOutput], dict[str, SeqOutput], Engine]:
    plain = run(make_engine(model_dir, **config), reqs)
    engine = make_engine(model_dir, **config, **spec)
    return plain, run(engine, reqs), engine


@pytest.mark.parametrize("spec", [MTP, CHAINED], ids=["k1", "k3"])
def test_mtp_drafts_are_accepted_and_greedy_output_is_unchanged(mtp_dir: Path, spec: dict[str, Any]) -> None:
    plain, out, engine = with_and_without(mtp_dir, requests(), spec)
    assert generated(out) == generated(plain)
    scheduler = engine.scheduler
    # Chained drafts are predicted from drafts: fewer of them hold.
    share = 0.8 if spec is MTP else 0.5
    assert scheduler.num_accepted_tokens > share * scheduler.num_draft_tokens > 0
    for output in out.values():  # what each request's usage reports
        assert 0 < output.seq.num_accepted_tokens <= output.seq.num_draft_tokens
    if spec is CHAINED:  # more than one token accepted per step, sometimes
        assert scheduler.num_accepted_tokens > sum(len(g) for g in generated(out).values()) / 2


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefills, each writing its MTP KV
        {"num_kv_blocks": 10, "block_size": 8},  # preemption, then the prefix cache's blocks
        {"deterministic": True},
    ],
    ids=["plain", "chunked", "preempted", "deterministic"],
)
@pytest.mark.parametrize("spec", [MTP, CHAINED], ids=["k1", "k3"])
def test_greedy_and_seeded_output_is_unchanged(
    mtp_hidden_dir: Path, config: dict[str, Any], spec: dict[str, Any]
) -> None:
    sampling = SamplingOptions(temperature=0.8, top_p=0.95, seed=5, repetition_penalty=1.1)
    reqs = [*requests(), make_request("seeded", prompt(random.Random(9), 30), 40, sampling=sampling)]
    plain, out, engine = with_and_without(mtp_hidden_dir, reqs, spec, **config)
    assert generated(out) == generated(plain)
    assert engine.scheduler.num_accepted_tokens > 0
    if "num_kv_blocks" in config:
        assert engine.num_preemptions > 0


def test_a_random_mtp_layer_leaves_output_unchanged(random_mtp_dir: Path) -> None:
    plain, spec, engine = with_and_without(random_mtp_dir, requests(count=3, max_tokens=32))
    assert generated(spec) == generated(plain)
    assert engine.scheduler.num_draft_tokens > 0


@pytest.mark.parametrize("spec", [MTP, CHAINED], ids=["k1", "k3"])
def test_each_draft_is_the_mtp_layers_prediction_from_the_whole_sequence(
    mtp_hidden_dir: Path, spec: dict[str, Any]
) -> None:
    # Incrementally: prompts in chunks of 16, then decode steps, some with accepted drafts.
    engine = make_engine(mtp_hidden_dir, max_num_batched_tokens=16, **spec)
    for r in requests(count=3, max_tokens=32):
        engine.add(r)
    states: list[tuple[list[int], list[int]]] = []
    while engine.has_unfinished():
        states += [(list(o.seq.token_ids), o.seq.draft) for o in engine.step() if not o.finished]
    assert engine.scheduler.num_accepted_tokens > 0
    # At once: one prefill of all tokens but the last, which the MTP layer is given.
    runner = make_runner(mtp_hidden_dir, **spec)
    blocks = Blocks(runner)
    for tokens, draft in states:
        seq = make_seqs([tokens[:-1]])[0]
        blocks.ensure(seq, len(tokens) + spec["num_speculative_tokens"] - 2)  # the chain's slots too
        out = SchedulerOutput([ScheduledChunk(seq, 0, len(tokens) - 1, True)])
        runner.execute(out)
        assert runner.propose(out, [[tokens[-1]]]) == [draft], len(tokens)
        blocks.free.extend(seq.block_table)


def test_mtp_needs_a_checkpoint_with_mtp_layers(tiny_deepseek_dir: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="1 MTP layers asked for, the checkpoint has 0"):
        make_engine(tiny_deepseek_dir, **MTP)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MTP layers"):
        make_engine(tiny_llama_dir, **MTP)
    with pytest.raises(ValueError, match="speculative_method must be ngram or mtp"):
        EngineConfig(model=str(tiny_deepseek_dir), speculative_method="eagle", num_speculative_tokens=2)  # type: ignore[arg-type]
