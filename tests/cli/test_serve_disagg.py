"""`weir serve --prefill-workers P --decode-workers D`: disaggregated serving as a subprocess,
queried with the official openai client. Greedy output is token-identical to `weir serve
--workers 1` (mocker and DeepInfer on a tiny Llama), with the usage of one request; the KV
really travels (the decode worker's pulls); `--disaggregation` / WEIR_DISAGGREGATION pick the
policy, and the frontend's metrics count each decision and time each handover."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from backends.registry import DEFAULT_MODEL
from tests.cli.procs import wait_healthy, weir, weir_process
from tests.cli.test_serve import Served
from tests.cluster import metric
from tests.completions import streamed_completion
from tests.servers import free_port

MOCKER = ["--backend", "mocker", "--speedup", "1000", "--block-size", "16"]
DISAGG = ["--prefill-workers", "1", "--decode-workers", "1"]
# Prompts below one block (its one partial block handed over), of several blocks, the same
# again (its prefix cached), and one ending at its first token (max_tokens 1: no decode).
PROMPTS = [
    ("Hi", 6),
    ("tell me about the river " * 12, 10),
    ("tell me about the river " * 12, 10),
    ("x y", 1),
]


@contextmanager
def serving(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    with weir_process("serve", *flags, "--port", str(port), log=log, env=env) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, proc, log)
        yield Served(proc, base_url, log)


Output = tuple[str, int, int, int, str | None]


def outputs(served: Served, model: str) -> list[Output]:
    """Each prompt's greedy completion, streamed: text, prompt, completion and cached tokens,
    finish reason."""
    results: list[Output] = []
    for prompt, max_tokens in PROMPTS:
        text, usage, finish = streamed_completion(served.client, model, prompt, max_tokens, seed=7)
        assert usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        results.append((text, usage.prompt_tokens, usage.completion_tokens, cached, finish))
    return results


def frontend_metric(served: Served, name: str, labels: str) -> float:
    return metric(httpx.get(f"{served.base_url}/metrics", timeout=5).text, name, labels)


def decisions(served: Served, model: str, outcome: str) -> float:
    return frontend_metric(
        served, "weir_frontend_disagg_decisions_total", f'model="{model}",outcome="{outcome}"'
    )


def check_disaggregated(served: Served, model: str, reference: list[Output]) -> None:
    assert outputs(served, model) == reference
    assert [r[2] for r in reference] == [n for _, n in PROMPTS]  # every request ran to max_tokens
    assert reference[2][3] > 0  # the repeated prompt was served from cache
    assert decisions(served, model, "disaggregated") == len(PROMPTS)
    assert decisions(served, model, "aggregated") == decisions(served, model, "fallback") == 0
    handovers = frontend_metric(served, "weir_frontend_disagg_handover_seconds_count", f'model="{model}"')
    assert handovers == len(PROMPTS) - 1  # max_tokens 1 ends at the prefill's token
    # Every decoded prompt's KV, its partial last block included, was pulled from the prefill
    # worker, not recomputed.
    pulled = 'worker="decode-1",direction="pulled",outcome="ok"'
    assert frontend_metric(served, "weir_worker_kv_transfers_total", pulled) == len(PROMPTS) - 1


def test_mocker_output_is_the_aggregated_output(tmp_path: Path) -> None:
    with serving(tmp_path, *MOCKER, "--workers", "1") as served:
        reference = outputs(served, DEFAULT_MODEL)
    with serving(tmp_path, *MOCKER, *DISAGG, "--disaggregation", "always") as served:
        lines = served.log.read_text().splitlines()
        assert (
            lines[0].startswith(f"weir serving {DEFAULT_MODEL} (1 prefill mocker worker at 127.0.0.1:")
            and ", 1 decode mocker worker at 127.0.0.1:" in lines[0]
        ), lines
        check_disaggregated(served, DEFAULT_MODEL, reference)


@pytest.mark.slow
def test_deepinfer_output_is_the_aggregated_output(tmp_path: Path) -> None:
    from backends.deepinfer.tiny import build_checkpoint

    model_dir = build_checkpoint(tmp_path / "tiny-llama", "llama")
    deepinfer = ["--backend", "deepinfer", "--model", str(model_dir), "--served-model-name", "tiny"]
    deepinfer += ["--device", "cpu", "--num-kv-blocks", "64", "--block-size", "16", "--deterministic"]
    env = {"OMP_NUM_THREADS": "1"}  # a shared machine's cores: torch threads waiting on each other
    with serving(tmp_path, *deepinfer, "--workers", "1", env=env) as served:
        reference = outputs(served, "tiny")
    with serving(tmp_path, *deepinfer, *DISAGG, "--disaggregation", "always", env=env) as served:
        check_disaggregated(served, "tiny", reference)


def test_never_and_adaptive(tmp_path: Path) -> None:
    short, long = "a short question", "word " * 2100
    with serving(tmp_path, *MOCKER, *DISAGG, env={"WEIR_DISAGGREGATION": "never"}) as served:
        for prompt in (short, long):
            served.client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=3)
        assert decisions(served, DEFAULT_MODEL, "aggregated") == 2
        assert decisions(served, DEFAULT_MODEL, "disaggregated") == 0
    # adaptive is the default; with Dynamo's threshold the short prompt stays whole
    with serving(tmp_path, *MOCKER, *DISAGG, "--disagg-min-uncached-tokens", "2048") as served:
        out = served.client.completions.create(model=DEFAULT_MODEL, prompt=short, max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
        assert decisions(served, DEFAULT_MODEL, "aggregated") == 1
        out = served.client.completions.create(
            model=DEFAULT_MODEL, prompt=long, max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert out.usage is not None and out.usage.completion_tokens == 3
        assert decisions(served, DEFAULT_MODEL, "disaggregated") == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill-workers", "1"], "--prefill-workers needs --decode-workers"),
        (["--workers", "0"], "--workers or --decode-workers must be at least 1"),
        (["--decode-workers", "-1"], "worker counts must not be negative"),
    ],
)
def test_bad_worker_counts_are_refused(flags: list[str], message: str) -> None:
    result = weir("serve", *MOCKER, *flags, timeout=30)
    assert result.returncode == 2
    assert message in result.stderr
