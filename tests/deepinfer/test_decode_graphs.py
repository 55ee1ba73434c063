"""Decode steps in fixed shapes (decode_graphs.py), against transformers and against the eager
path: on a GPU the runner captures and replays them as CUDA graphs; on a CPU, which has no
graphs, the same fixed-shape steps run eagerly, so the padding, the workspace rows carried
between steps and the masks are checked here too."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest

from backends.deepinfer.args import deepinfer_config_from_args
from backends.deepinfer.decode_graphs import batch_sizes
from backends.deepinfer.model_runner import ModelRunner
from backends.deepinfer.tiny import build_checkpoint
from backends.registry import add_backend_arguments
from tests.deepinfer.device import DEVICE
from tests.deepinfer.test_engine import generated, make_engine, request, run
from tests.deepinfer.test_models import (
    assert_a_changing_batch_matches,
    assert_decoding_matches,
    make_runner,
    random_prompts,
    reference,
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
    prompts = random_prompts(runner.vocab_size, (20, 30), seed=5)
    assert_decoding_matches(runner, reference(tiny_llama_dir), prompts, 3)
    assert graphs.steps == 0


def test_a_changing_batch_matches_transformers(tiny_llama_dir: Path) -> None:
    """Sequences joining (after an eager prefill step), leaving and changing places, batches
    padded to the next graph size, and contexts outgrowing the first workspace (256 positions):
    every row must read its own K/V."""
    runner, ref = graphed(make_runner(tiny_llama_dir)), reference(tiny_llama_dir)
    prompts = random_prompts(runner.vocab_size, (5, 240, 9, 30), seed=3)
    assert_a_changing_batch_matches(runner, ref, prompts, 24)  # 240 + 24: past the first workspace
    assert runner.graphs is not None and runner.graphs._rows.capacity == 512 and runner.graphs.steps > 0


def test_a_sliding_window_model_matches_transformers_past_its_window(tmp_path: Path) -> None:
    model_dir = build_checkpoint(
        tmp_path, "llama", architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8
    )
    runner = graphed(make_runner(model_dir))
    prompts = random_prompts(runner.vocab_size, (20, 5, 13), seed=2)
    assert_decoding_matches(runner, reference(model_dir), prompts, 12)
    assert runner.graphs is not None and runner.graphs.steps == 12


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
