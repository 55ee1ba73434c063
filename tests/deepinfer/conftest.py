"""DeepInfer fixtures: checkpoints built locally (tiny random models, the converted SmolLM2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backends.deepinfer.smollm2 import ensure_default_model, gguf_path
from backends.deepinfer.tiny import build_checkpoint


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
