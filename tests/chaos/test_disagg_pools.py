"""Disaggregated pools in separate processes: 2 `weir worker --role prefill` and 2 `--role
decode` workers behind `weir frontend --disaggregation always`, over real etcd and NATS,
queried with the official openai client; DeepInfer on a tiny random Llama (`--deterministic`)
and the mocker on its tokenizer.

1. Greedy output is token-identical to one aggregated worker (`weir serve --workers 1`) on
   prompts that share prefixes and one of many blocks; both prefill workers serve transfers
   and both decode workers pull them (their own /metrics), over shared memory; every block
   is freed after.
2. A prefill worker SIGKILLed mid-transfer (it answered the first token and holds the KV; the
   decode worker's pull has reached it): the request completes with the aggregated text, the
   decode worker computing the prompt; the kill ends the pull at once (the kernel resets the
   dead worker's sockets), far inside `kv_pull_timeout_s`, with no fallback; blocks are freed
   on the decode workers and on the surviving prefill worker, which serves the next requests;
   no `weir-kv-*` segment is left in /dev/shm.

No test hooks: "mid-transfer" and "each worker used" come from SIGSTOP. A stopped worker's
kernel still accepts connections and queues what callers send, so bytes waiting in a stopped
worker's socket (/proc/net/tcp's rx_queue) show a call was dispatched to it, and while it
waits the frontend counts it as that worker's load, which sends the next call elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from orchestrator.runtime.kv_transfer import SHM_DIR
from orchestrator.runtime.worker_host import DEFAULT_KV_PULL_TIMEOUT_S
from tests.cli.procs import wait_healthy, weir_process
from tests.cluster import Cluster, metric, planes, start_frontend
from tests.completions import streamed_completion
from tests.servers import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # five processes loading a model

MODEL = "tiny"
MAX_TOKENS = 8
LEASE_TTL = "5"  # a killed worker leaves discovery within the test; stopped ones stay (< 1 s)
ENV = {"OMP_NUM_THREADS": "1"}  # a shared machine's cores: torch threads waiting on each other
_FOX = "The quick brown fox jumps over the lazy dog. "
# Two fresh prompts sent at once (one to each prefill worker), then prompts sharing their
# prefixes, one of many 16-token blocks, and one the kill test sends on the survivor.
FIRST_ROUND = ["What is the capital of France? ", "def generate(prompt: str, max_tokens: int = 16) -> "]
LATER = [
    "What is the capital of France? The capital of France is",
    "def generate(prompt: str, max_tokens: int = 16) -> list[int]: return",
    _FOX * 10 + "Readability counts.",
]
KILLED = "Beautiful is better than ugly. Explicit is better than implicit. " * 3
SURVIVOR = "Errors should never pass silently. Unless explicitly silenced. " * 2
ALL = [*FIRST_ROUND, *LATER, KILLED, SURVIVOR]
PREFILL, DECODE = ("prefill-0", "prefill-1"), ("decode-0", "decode-1")


def complete(client: openai.OpenAI, prompt: str) -> str:
    """`prompt`'s greedy completion, streamed, run to MAX_TOKENS."""
    text, usage, _ = streamed_completion(client, MODEL, prompt, MAX_TOKENS, seed=3)
    assert usage.completion_tokens == MAX_TOKENS
    return text


def unread_calls(port: int) -> int:
    """Connections into 127.0.0.1:`port` holding bytes its process has not read: calls queued
    at a stopped worker. /proc/net/tcp rows: local address, remote, state (01 established),
    tx_queue:rx_queue in hex."""
    local = f"0100007F:{port:04X}"
    rows = (line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:])
    return sum(1 for r in rows if r[1] == local and r[3] == "01" and int(r[4].split(":")[1], 16) > 0)


def kv_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("weir-kv-*")}


@contextmanager
def stopped(*procs: subprocess.Popen[bytes]) -> Iterator[None]:
    """SIGSTOP `procs`; SIGCONT them on exit (one already dead is skipped)."""
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)


@dataclass
class Pools:
    cluster: Cluster
    procs: dict[str, subprocess.Popen[bytes]]
    ports: dict[str, int]  # request-plane port per worker
    reference: dict[str, str]  # prompt -> the aggregated worker's text

    def worker_metric(self, worker: str, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.cluster.workers[worker]}/metrics", timeout=5).text
        return metric(text, name, ",".join(filter(None, (f'worker="{worker}"', labels))))

    def transfers(self, worker: str, direction: str, outcome: str) -> float:
        labels = f'direction="{direction}",outcome="{outcome}"'
        return self.worker_metric(worker, "weir_worker_kv_transfers_total", labels)

    def served_ok(self, worker: str) -> float:
        return self.worker_metric(worker, "weir_worker_requests_total", 'outcome="ok"')

    def active_blocks(self, worker: str) -> float:
        return self.worker_metric(worker, "weir_worker_kv_blocks_active")

    def wait_blocks_freed(self, workers: tuple[str, ...]) -> None:
        wait_until(
            lambda: all(self.active_blocks(w) == 0 for w in workers), f"{workers} to free their KV blocks", 10
        )

    def wait_unread(self, workers: tuple[str, ...], what: str) -> None:
        wait_until(lambda: all(unread_calls(self.ports[w]) for w in workers), what, 30)

    def decisions(self, outcome: str) -> float:
        labels = f'model="{MODEL}",outcome="{outcome}"'
        return self.cluster.frontend_metric("weir_frontend_disagg_decisions_total", labels)


def engine_args(backend: str, checkpoint: Path) -> list[str]:
    """DeepInfer in its batch-invariant mode, or the mocker (near-zero step times), on the
    tiny checkpoint (the mocker uses only its tokenizer), 16-token blocks."""
    args = [
        "--backend",
        backend,
        "--model",
        str(checkpoint),
        "--served-model-name",
        MODEL,
        "--block-size",
        "16",
    ]
    if backend == "mocker":
        return [*args, "--speedup", "1000", "--num-blocks", "64"]
    return [*args, "--device", "cpu", "--num-kv-blocks", "64", "--deterministic"]


@pytest.fixture(scope="module", params=["deepinfer", "mocker"])
def pools(
    request: pytest.FixtureRequest, etcd_url: str, nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pools]:
    from backends.deepinfer.tiny import build_checkpoint

    tmp = tmp_path_factory.mktemp(f"disagg-pools-{request.param}")
    engine = engine_args(request.param, build_checkpoint(tmp / "tiny-llama", "llama"))
    plane_args = planes(etcd_url, nats_url, "disagg-pools")
    with ExitStack() as stack:
        procs, ports, metrics_urls = {}, {}, {}
        for name in (*PREFILL, *DECODE):
            ports[name], metrics_port = free_port(), free_port()
            procs[name] = stack.enter_context(
                weir_process(
                    "worker",
                    *engine,
                    *plane_args,
                    *("--role", name.split("-")[0], "--instance-id", name, "--lease-ttl", LEASE_TTL),
                    *("--port", str(ports[name]), "--metrics-port", str(metrics_port)),
                    log=tmp / f"{name}.log",
                    env=ENV,
                )
            )
            metrics_urls[name] = f"http://127.0.0.1:{metrics_port}"
        # The reference starts beside the cluster and is gone before the tests run.
        port = free_port()
        log = tmp / "aggregated.log"
        with weir_process("serve", *engine, "--workers", "1", "--port", str(port), log=log, env=ENV) as serve:
            wait_healthy(f"http://127.0.0.1:{port}", serve, log, timeout=180)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            reference = {prompt: complete(client, prompt) for prompt in ALL}
        url, _ = start_frontend(stack, plane_args, tmp, 4, "--disaggregation", "always")
        yield Pools(Cluster(url, metrics_urls), procs, ports, reference)


def test_two_by_two_pools_match_aggregated_and_both_of_each_serve(pools: Pools) -> None:
    client = pools.cluster.client
    # Both fresh prompts are dispatched while every worker is stopped: the first's prefill,
    # then its decode, counts as its worker's load, so the second goes to the other worker of
    # each pool (KV-aware prefill with no cached prefix anywhere; decode by least load).
    with concurrent.futures.ThreadPoolExecutor(len(FIRST_ROUND)) as threads:
        with stopped(*(pools.procs[w] for w in DECODE)):
            with stopped(*(pools.procs[w] for w in PREFILL)):
                futures = [threads.submit(complete, client, prompt) for prompt in FIRST_ROUND]
                pools.wait_unread(PREFILL, "a prefill queued at each prefill worker")
            pools.wait_unread(DECODE, "a decode queued at each decode worker")
        assert [f.result(60) for f in futures] == [pools.reference[p] for p in FIRST_ROUND]
    for prompt in LATER:  # prefixes cached on the prefill worker that computed them
        assert complete(client, prompt) == pools.reference[prompt]

    n = len(FIRST_ROUND) + len(LATER)
    assert pools.decisions("disaggregated") == n
    assert pools.decisions("fallback") == pools.decisions("aggregated") == 0
    served = [pools.transfers(w, "served", "ok") for w in PREFILL]
    pulled = [pools.transfers(w, "pulled", "ok") for w in DECODE]
    assert min(served) >= 1 and min(pulled) >= 1, (served, pulled)
    assert sum(served) == sum(pulled) == n  # every prompt's KV travelled, none recomputed
    shm = sum(
        pools.worker_metric(w, "weir_worker_kv_transfer_bytes_total", 'direction="pulled",transport="shm"')
        for w in DECODE
    )
    assert shm > 0  # one host: shared memory
    pools.wait_blocks_freed((*PREFILL, *DECODE))  # held blocks released after each pull
    assert not any(pools.transfers(w, "served", "expired") for w in PREFILL)


def test_a_prefill_worker_killed_mid_transfer(pools: Pools) -> None:
    client = pools.cluster.client
    segments = kv_segments()
    before = {w: pools.served_ok(w) for w in PREFILL}
    failed = sum(pools.transfers(w, "pulled", "failed") for w in DECODE)
    disaggregated = pools.decisions("disaggregated")
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        with stopped(*(pools.procs[w] for w in DECODE)):
            request = thread.submit(complete, client, KILLED)
            # The prefill worker that computed the first token ended its call and holds the KV
            # (the first token's text may be held back, so the frontend's view, not the client's).
            wait_until(lambda: any(pools.served_ok(w) > before[w] for w in PREFILL), "the prefill", 30)
            (victim,) = [w for w in PREFILL if pools.served_ok(w) > before[w]]
            (survivor,) = [w for w in PREFILL if w != victim]
            wait_until(lambda: pools.active_blocks(victim) > 0, f"{victim} to report its held blocks", 5)
            wait_until(
                lambda: any(unread_calls(pools.ports[w]) for w in DECODE), "the decode to be queued", 30
            )
            pools.procs[victim].send_signal(signal.SIGSTOP)
            assert unread_calls(pools.ports[victim]) == 0  # nothing else is on its way to it
        # The decode worker's pull reaches the stopped prefill worker and waits there.
        wait_until(lambda: unread_calls(pools.ports[victim]) > 0, "the KV pull to reach the prefill", 30)
        pools.procs[victim].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        pools.procs[victim].wait(10)
        assert request.result(30) == pools.reference[KILLED]
    # The reset ended the pull at once, not its timeout: the rest was the prompt's compute.
    assert time.monotonic() - killed_at < DEFAULT_KV_PULL_TIMEOUT_S / 2
    assert sum(pools.transfers(w, "pulled", "failed") for w in DECODE) == failed + 1
    pools.wait_blocks_freed(DECODE)

    # Once the dead worker's lease is gone, the survivor takes the prefills again.
    wait_until(lambda: pools.cluster.known_workers() == 3, "the killed worker to leave discovery", 20)
    served = pools.transfers(survivor, "served", "ok")
    for prompt in (SURVIVOR, LATER[0]):
        assert complete(client, prompt) == pools.reference[prompt]
    assert pools.transfers(survivor, "served", "ok") == served + 2
    pools.wait_blocks_freed((survivor, *DECODE))
    assert pools.decisions("disaggregated") == disaggregated + 3
    assert pools.decisions("fallback") == 0  # the prefill succeeded: the decode recomputed
    wait_until(lambda: kv_segments() <= segments, "no weir-kv-* segment left in /dev/shm", 10)
