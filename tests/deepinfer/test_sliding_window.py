"""Sliding-window attention (Mistral's `sliding_window`) on a tiny random Mistral with a window
of 8 tokens, against transformers past the window: the runner's logits, and the whole engine's
greedy output with chunked prefill, the prefix cache, a small cache and speculation, while each
sequence holds only the blocks its window can still reach; and a prefix resumed from the blocks
its window needs when the first ones were evicted."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.deepinfer.engine import Engine
from backends.deepinfer.kv_cache_manager import NULL_BLOCK
from backends.deepinfer.tiny import build_checkpoint
from tests.deepinfer.test_engine import generated, make_engine, prompt, request, run
from tests.deepinfer.test_models import (
    Blocks,
    assert_decoding_matches,
    make_runner,
    make_seqs,
    random_prompts,
    reference,
    reference_last_logits,
    step,
)

WINDOW, BLOCK = 8, 4
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(
        tmp_path_factory.mktemp("tiny-mistral"),
        "llama",
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        sliding_window=WINDOW,
    )


def test_logits_match_transformers_past_the_window(mistral_dir: Path) -> None:
    runner, ref = make_runner(mistral_dir), reference(mistral_dir)
    assert runner.sliding_window == WINDOW and runner.max_model_len == 2048  # no cap to the window
    seqs = assert_decoding_matches(runner, ref, random_prompts(runner.vocab_size, (20, 5, 13), seed=2), 12)
    # The window matters here: attending to everything gives other logits.
    full = make_runner(mistral_dir, max_model_len=64)
    full.sliding_window = None
    for layer in full._cache_layers:
        layer.sliding_window = None
    seq = make_seqs([seqs[0].token_ids[:20]])[0]
    everything = step(full, Blocks(full), [(seq, 0, 20, True)])[0]
    assert (everything - reference_last_logits(ref, seq.token_ids)).abs().max() > 0.1


def reference_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    ref = reference(model_dir)
    outputs = []
    for p in prompts:
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None
            )
        outputs.append(out[0, len(p) :].tolist())
    return outputs


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    """Greedy outputs, and the most blocks any running sequence held at once."""
    for i, p in enumerate(prompts):
        engine.add(request(f"r{i}", p, max_tokens))
    outputs: dict[str, list[int]] = {}
    most = 0
    while engine.has_unfinished():
        for o in engine.step():
            outputs.setdefault(o.seq.request_id, []).extend(t.token_id for t in o.new_tokens)
        for seq in engine.scheduler.running:
            most = max(most, sum(b != NULL_BLOCK for b in seq.block_table))
    return [outputs[f"r{i}"] for i in range(len(prompts))], most


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 6},  # prompts prefilled in chunks smaller than the window
        {"num_kv_blocks": 18},  # less than the three sequences' 70 tokens would need without the window
        {"num_speculative_tokens": 3},
    ],
    ids=["plain", "chunked", "small-cache", "speculative"],
)
def test_engine_output_matches_transformers_with_kv_bounded_by_the_window(
    mistral_dir: Path, config: dict[str, Any]
) -> None:
    prompts = [prompt(random.Random(i), n) for i, n in enumerate((21, 9, 30))]
    engine = make_engine(mistral_dir, block_size=BLOCK, **{"num_kv_blocks": 64, **config})
    outputs, most = run_engine(engine, prompts, 40)
    assert outputs == reference_greedy(mistral_dir, prompts, 40)
    # After each step: the window's 8 tokens span at most 3 blocks of 4, plus the block the
    # next token goes in (or a draft's).
    assert most <= WINDOW // BLOCK + 2
    kv = engine.scheduler.kv_cache
    assert kv.pool.num_free_blocks == kv.num_blocks  # every block back, none twice
    if not config:
        # The same prompt again starts from the prefix cache and decodes the same tokens.
        again, _ = run_engine(engine, prompts[:1], 40)
        assert again == outputs[:1]


def test_a_window_only_some_layers_use_matches_transformers_past_it(tmp_path: Path) -> None:
    """Qwen2's max_window_layers: full attention below it, the window from it on. Each layer
    attends as its own; no KV is released, since the full layers read all of it."""
    model_dir = build_checkpoint(
        tmp_path, "qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    runner, ref = make_runner(model_dir), reference(model_dir)
    assert runner.sliding_window is None and runner.max_model_len == 2048
    assert [layer.sliding_window for layer in runner._cache_layers] == [None, WINDOW]
    assert_decoding_matches(runner, ref, random_prompts(runner.vocab_size, (19, 11), seed=4), 10)


def test_a_preempted_sequence_gives_back_only_the_blocks_it_still_holds(mistral_dir: Path) -> None:
    engine = make_engine(mistral_dir, block_size=BLOCK, num_kv_blocks=32)
    engine.add(request("r", prompt(random.Random(3), 30), 20))
    scheduler = engine.scheduler
    for _ in range(3):
        engine.step()
    seq = scheduler.running[0]
    assert seq.block_table[:4] == [NULL_BLOCK] * 4  # the prompt's first blocks slid out
    held = sum(b != NULL_BLOCK for b in seq.block_table)
    free = scheduler.kv_cache.pool.num_free_blocks
    scheduler.kv_cache.deallocate(seq)  # what preemption does
    assert scheduler.kv_cache.pool.num_free_blocks == free + held == scheduler.kv_cache.num_blocks


def test_a_prefix_resumes_from_its_window_after_its_first_blocks_were_evicted(mistral_dir: Path) -> None:
    engine = make_engine(mistral_dir, block_size=BLOCK, num_kv_blocks=16)
    pool = engine.scheduler.kv_cache.pool
    tokens = prompt(random.Random(1), 40)
    first = run(engine, [request("a", tokens, 8)])["a"]
    # Another request takes the free blocks the prefix cache holds, oldest first: the prompt's
    # first block goes, the rest stays.
    run(engine, [request("c", prompt(random.Random(2), 20), 4)])
    hashes = first.seq.block_hashes
    assert hashes[0] not in pool.cached and all(h in pool.cached for h in hashes[7:9])
    again = run(engine, [request("b", tokens, 8)])["b"]
    # Its 9 full prompt blocks count as cached: the window of token 36 reaches back only to
    # block 7, so blocks 0-6 are not needed.
    assert again.seq.num_cached_tokens == 36
    assert generated({"b": again}) == generated({"b": first})
