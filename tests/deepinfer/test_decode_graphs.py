"""Decode steps in fixed shapes (decode_graphs.py), against transformers and against the eager
path: on a GPU the runner captures and replays them as CUDA graphs; on a CPU, which has no
graphs, the same fixed-shape steps run eagerly, so the padding, the workspace rows carried
between steps and the masks are checked here too."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
import torch

from backends.deepinfer.args import deepinfer_config_from_args
from backends.deepinfer.decode_graphs import batch_sizes
from backends.deepinfer.model_runner import ModelRunner
from backends.deepinfer.sequence import Sequence
from backends.deepinfer.tiny import build_checkpoint
from backends.registry import add_backend_arguments
from tests.deepinfer.device import DEVICE
from tests.deepinfer.test_engine import generated, make_engine, request, run
from tests.deepinfer.test_models import (
    TINY_ATOL,
    Blocks,
    make_runner,
    make_seqs,
    random_prompts,
    reference,
    reference_last_logits,
    step,
)

pytest.importorskip("transformers")


def graphed(runner: ModelRunner) -> ModelRunner:
    """The runner with fixed-shape decode steps: its own CUDA graphs on a GPU, eager on a CPU."""
    if DEVICE.startswith("cuda"):
        assert runner.graphs is not None and runner.graphs.capture
    else:
        assert runner.graphs is None  # no graphs on a CPU unless asked
        runner.graphs = runner.decode_graphs(capture=False)
    return runner


def test_batch_sizes_are_vllms() -> None:
    assert batch_sizes(1) == [1]
    assert batch_sizes(5) == [1, 2, 4, 8]
    assert batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


def test_enforce_eager_turns_the_graphs_off(tiny_llama_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    add_backend_arguments(parser)
    # The flags every backend shares, which `weir worker` defaults per backend.
    shared = ["--block-size", "16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]
    config = deepinfer_config_from_args(parser.parse_args([*shared, "--enforce-eager"]), tiny_llama_dir, "t")
    assert config.enforce_eager
    assert not deepinfer_config_from_args(parser.parse_args(shared), tiny_llama_dir, "t").enforce_eager
    assert make_runner(tiny_llama_dir, enforce_eager=True).graphs is None
    assert (make_runner(tiny_llama_dir).graphs is not None) == DEVICE.startswith("cuda")


def test_a_step_whose_workspaces_would_outgrow_the_cache_runs_eagerly(tiny_llama_dir: Path) -> None:
    """The workspaces copy the decoding sequences' KV, padded: no larger than the cache, or
    the step runs eagerly (as the same logits show)."""
    runner = graphed(make_runner(tiny_llama_dir, num_kv_blocks=80))  # 320 positions
    graphs = runner.graphs
    assert graphs is not None and graphs.fits(1, 256) and not graphs.fits(2, 256)
    ref = reference(tiny_llama_dir)
    seqs, blocks = make_seqs(random_prompts(runner.vocab_size, (20, 30), seed=5)), Blocks(runner)
    logits = step(runner, blocks, [(s, 0, len(s.token_ids), True) for s in seqs])
    for _ in range(3):
        for seq, row in zip(seqs, logits, strict=True):
            torch.testing.assert_close(row, reference_last_logits(ref, seq.token_ids), atol=TINY_ATOL, rtol=0)
            seq.token_ids.append(int(row.argmax()))
        logits = step(runner, blocks, [(s, len(s.token_ids) - 1, 1, True) for s in seqs])
    assert graphs.steps == 0


def test_a_changing_batch_matches_transformers(tiny_llama_dir: Path) -> None:
    """Sequences joining (after an eager prefill step), leaving and changing places, batches
    padded to the next graph size, and contexts outgrowing the first workspace (256 positions):
    every row must read its own K/V."""
    runner, ref = graphed(make_runner(tiny_llama_dir)), reference(tiny_llama_dir)
    a, b, c, d = make_seqs(random_prompts(runner.vocab_size, (5, 240, 9, 30), seed=3))
    blocks = Blocks(runner, seed=8)
    batch: list[Sequence] = [a, b, d]
    logits = step(runner, blocks, [(s, 0, len(s.token_ids), True) for s in batch])
    for i in range(24):  # b: 240 + 24 tokens, past the first workspace
        for seq, row in zip(batch, logits, strict=True):
            torch.testing.assert_close(row, reference_last_logits(ref, seq.token_ids), atol=TINY_ATOL, rtol=0)
            seq.token_ids.append(int(row.argmax()))
        chunks = [(s, len(s.token_ids) - 1, 1, True) for s in batch]
        if i == 2:  # c joins with its prefill: an eager step; it decodes from the next one on
            chunks.append((c, 0, len(c.token_ids), True))
            batch = [*batch, c]
        elif i == 6:  # a leaves
            chunks, batch = chunks[1:], batch[1:]
        elif i == 9:  # the others change places
            chunks, batch = chunks[::-1], batch[::-1]
        logits = step(runner, blocks, chunks)
    assert runner.graphs is not None and runner.graphs._rows.capacity == 512


def test_a_sliding_window_model_matches_transformers_past_its_window(tmp_path: Path) -> None:
    window = 8
    model_dir = build_checkpoint(
        tmp_path, "llama", architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window
    )
    runner, ref = graphed(make_runner(model_dir)), reference(model_dir)
    seqs = make_seqs(random_prompts(runner.vocab_size, (20, 5, 13), seed=2))
    blocks = Blocks(runner)
    logits = step(runner, blocks, [(s, 0, len(s.token_ids), True) for s in seqs])
    for _ in range(12):
        for seq, row in zip(seqs, logits, strict=True):
            torch.testing.assert_close(row, reference_last_logits(ref, seq.token_ids), atol=TINY_ATOL, rtol=0)
            seq.token_ids.append(int(row.argmax()))
        logits = step(runner, blocks, [(s, len(s.token_ids) - 1, 1, True) for s in seqs])


def test_the_engine_gives_the_eager_engines_greedy_output(tiny_qwen2_dir: Path) -> None:
    """The whole engine, with requests arriving and finishing at different steps and prefix
    hits: the same tokens with fixed-shape decode steps as without."""
    rng = random.Random(4)
    shared = [rng.randrange(3, 500) for _ in range(24)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 9, 30, 1, 12)]

    def generate(graphs: bool) -> tuple[dict[str, list[int]], int]:
        engine = make_engine(tiny_qwen2_dir, max_num_batched_tokens=64, enforce_eager=not graphs)
        runner = engine.runner
        assert isinstance(runner, ModelRunner)
        if graphs:
            graphed(runner)
        requests = [request(f"r{i}", p, max_tokens=8 + 3 * i) for i, p in enumerate(prompts)]
        out = generated(run(engine, requests))
        return out, runner.graphs.steps if runner.graphs is not None else 0

    (eager, none), (fixed, steps) = generate(False), generate(True)
    assert fixed == eager and len(eager["r5"]) == 23
    assert none == 0 and steps >= 15  # most steps decode only: r5 alone runs 10 at the end
