"""The real `weir serve` as a subprocess, queried with the official openai client over HTTP."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from backends.mocker.config import MockerConfig
from backends.mocker.core import MockerCore
from backends.registry import DEFAULT_BACKEND, DEFAULT_MODEL
from tests.cli.procs import stop, wait_banner, wait_healthy, weir_process
from tests.cluster import metric
from tests.servers import free_port

# Mocker workers with near-zero step time: these tests are about the CLI and the HTTP surface.
MOCKER = ["--backend", "mocker", "--speedup", "1000"]


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], base_url: str, log: Path) -> None:
        self.proc = proc
        self.base_url = base_url
        self.log = log
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with weir_process("serve", *MOCKER, "--workers", "2", "--port", str(port), log=log) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, proc, log)
        yield Served(proc, base_url, log)


def test_prints_one_line_with_address_and_model(served: Served) -> None:
    lines = served.log.read_text().splitlines()
    assert len(lines) == 1
    assert re.fullmatch(
        rf"weir serving {DEFAULT_MODEL} \(2 mocker workers at 127\.0\.0\.1:\d+, 127\.0\.0\.1:\d+\) "
        rf"on {re.escape(served.base_url)}",
        lines[0],
    ), lines[0]


def test_models(served: Served) -> None:
    assert [m.id for m in served.client.models.list().data] == [DEFAULT_MODEL]


def test_chat(served: Served) -> None:
    reply = served.client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 0


def test_chat_without_max_tokens_ends_with_eos(served: Served) -> None:
    # As the README's first request: no max_tokens, so only the mocker's EOS ends it early.
    reply = served.client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Hello!"}], seed=5
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == MockerCore(MockerConfig()).output_length(5)
    content = reply.choices[0].message.content or ""
    assert content and "<|im_end|>" not in content  # the EOS token is not text


def test_completion(served: Served) -> None:
    reply = served.client.completions.create(
        model=DEFAULT_MODEL, prompt="Once upon a time", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 5


def test_streaming_chat_and_completion(served: Served) -> None:
    chat = served.client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "Count to ten."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(chat)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]

    completion = served.client.completions.create(
        model=DEFAULT_MODEL, prompt="A B C", max_tokens=6, stream=True, extra_body={"ignore_eos": True}
    )
    finishes = [c.choices[0].finish_reason for c in completion if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]


def test_unknown_model_is_a_404_in_openai_shape(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        served.client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert "no-such-model" in str(info.value)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with weir_process("serve", *MOCKER, "--port", str(port), log=log) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, proc, log)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)
        assert client.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=2).choices
        assert stop(proc, sig) == 0
    output = log.read_text()
    assert "Traceback" not in output, output


def test_api_key_from_the_environment(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    env = {"WEIR_API_KEY": "sk-from-env"}
    with weir_process("serve", *MOCKER, "--port", str(port), log=log, env=env) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, proc, log)  # /health needs no key
        right = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-from-env", max_retries=0, timeout=30)
        assert right.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=2).choices
        wrong = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-other", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=2)
    assert "sk-from-env" not in log.read_text()


@pytest.mark.slow
def test_default_serve_answers_with_deepinfer(tmp_path: Path) -> None:
    """No flags but --port 0: the default backend (DeepInfer) on the default model, SmolLM2."""
    log = tmp_path / "serve.log"
    with weir_process("serve", "--port", "0", log=log) as proc:
        base_url = wait_banner(proc, log)
        banner = f"weir serving {DEFAULT_MODEL} (1 {DEFAULT_BACKEND} worker at 127.0.0.1:"
        assert banner in log.read_text() and f") on {base_url}" in log.read_text()
        wait_healthy(base_url, proc, log)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        assert stop(proc, signal.SIGTERM) == 0


def test_ttft_routing_serves(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    argv = ["serve", *MOCKER, "--workers", "2", "--router-mode", "ttft", "--port", str(port)]
    with weir_process(*argv, log=log) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, proc, log)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)
        for _ in range(3):
            reply = client.completions.create(model=DEFAULT_MODEL, prompt="Hello " * 200, max_tokens=4)
            assert reply.usage is not None and reply.usage.completion_tokens == 4
        metrics = httpx.get(f"{base_url}/metrics", timeout=5).text
        labels = f'mode="ttft",model="{DEFAULT_MODEL}"'
        assert metric(metrics, "weir_router_decisions_total", labels) == 3
        assert metric(metrics, "weir_router_predicted_ttft_seconds_count", labels) == 3


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_deepinfer_speculative_decoding_serves(tmp_path: Path, method: str) -> None:
    """`--speculative-config` (vLLM's JSON: n-gram on a tiny Llama, MTP on a tiny DeepSeek-V3
    whose MTP layer predicts) on DeepInfer: the stream is whole, its usage counts the drafts
    accepted and rejected (OpenAI's `completion_tokens_details`), and /metrics the drafts
    verified and accepted."""
    from backends.deepinfer.tiny import build_checkpoint, build_mtp_checkpoint

    if method == "mtp":
        model, spec = build_mtp_checkpoint(tmp_path / "tiny-deepseek-mtp"), '{"method": "mtp"}'
    else:
        model = build_checkpoint(tmp_path / "tiny-llama", "llama")
        spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    argv = ["serve", "--backend", "deepinfer", "--model", str(model), "--served-model-name", "tiny"]
    argv += ["--num-kv-blocks", "64", "--speculative-config", spec, "--port", "0"]
    log = tmp_path / "serve.log"
    with weir_process(*argv, log=log, env={"OMP_NUM_THREADS": "1"}) as proc:
        base_url = wait_banner(proc, log)
        wait_healthy(base_url, proc, log)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny",
            prompt=list(range(5, 29)),
            max_tokens=64,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert usage and usage[-1].completion_tokens == 64
        details = usage[-1].completion_tokens_details
        assert details is not None and details.accepted_prediction_tokens
        metrics = httpx.get(f"{base_url}/metrics", timeout=5).text
        drafted = metric(metrics, "weir_deepinfer_spec_draft_tokens_total", 'model="tiny"')
        accepted = metric(metrics, "weir_deepinfer_spec_accepted_tokens_total", 'model="tiny"')
        assert accepted == details.accepted_prediction_tokens
        assert drafted == accepted + (details.rejected_prediction_tokens or 0), (drafted, details)
        # A request that never decodes past its first token reports no details at all.
        plain = client.completions.create(model="tiny", prompt=[7], max_tokens=1, temperature=0)
        assert plain.usage is not None and plain.usage.completion_tokens_details is None
        assert stop(proc, signal.SIGTERM) == 0


def test_an_unsupported_speculative_method_is_refused_at_start(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    spec = '{"method": "eagle", "num_speculative_tokens": 4}'
    with weir_process("serve", "--speculative-config", spec, "--port", "0", log=log) as proc:
        assert proc.wait(timeout=60) == 2
    assert 'DeepInfer speculates with "ngram"' in log.read_text()
