"""DeepInfer fixtures: checkpoints built locally (tiny random models; the converted SmolLM2 is
`smollm2_dir`, in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.deepinfer.tiny import build_checkpoint

# The test machine's few cores are shared by many processes; torch's OpenMP threads then wait on
# each other at every barrier (a 2-thread matmul ran ~100x slower than a 1-thread one here).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-deepseek-v3"), "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe")
