"""DeepInfer fixtures: checkpoints built locally (tiny random models, the converted SmolLM2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from backends.deepinfer.smollm2 import ensure_default_model, gguf_path
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
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted default model; reuses $WEIR_CACHE_DIR when set (CI caches it), else a
    per-session temporary cache (conversion takes ~5 s)."""
    try:
        gguf_path()
    except FileNotFoundError as exc:  # the package is an optional install (--no-deps)
        pytest.skip(str(exc))
    root = os.environ.get("WEIR_CACHE_DIR")
    return ensure_default_model(Path(root) if root else tmp_path_factory.mktemp("weir-cache"))
