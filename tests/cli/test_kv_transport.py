"""`weir worker --kv-transport mooncake`: a prefill and a decode worker on "two hosts" (the
decode worker in a mount namespace of its own with a /dev/shm of its own, as a container on
another node has, so shared memory is out) move the prompt's KV through Mooncake's transfer
engine, behind `weir frontend --disaggregation always`, over real etcd and NATS, queried with
the official openai client. Each worker's /metrics shows the bytes on the fabric and none on
the request plane's TCP stream."""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.cli.procs import REPO, WEIR, weir, weir_process
from tests.cluster import LEASE_TTL, Cluster, metric, planes, start_frontend
from tests.completions import streamed_completion
from tests.servers import free_port, stop_process

MOCKER = ["--backend", "mocker", "--served-model-name", "mocker", "--speedup", "1000", "--block-size", "16"]
WORKER = [*MOCKER, "--kv-transport", "mooncake"]
PROMPT = "tell me about the river " * 12  # several 16-token blocks


def on_another_host(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`weir ARGS` with a /dev/shm of its own (needs root, as CI and the developers' machines
    run: unshare's mount namespace)."""
    mount = 'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$@"'
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *WEIR, *args]
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare")
def test_the_kv_travels_through_mooncake_between_hosts(
    etcd_url: str, nats_url: str, tmp_path: Path, mooncake: None
) -> None:
    plane_args = planes(etcd_url, nats_url, "mooncake")
    ports = {"prefill-0": free_port(), "decode-0": free_port()}
    common = [*WORKER, *plane_args, "--lease-ttl", str(LEASE_TTL)]
    with ExitStack() as stack:
        stack.enter_context(
            weir_process(
                "worker",
                *(*common, "--role", "prefill", "--instance-id", "prefill-0"),
                *("--metrics-port", str(ports["prefill-0"])),
                log=tmp_path / "prefill-0.log",
            )
        )
        decode_args = [*common, "--role", "decode", "--instance-id", "decode-0"]
        decode = on_another_host(
            ["worker", *decode_args, "--metrics-port", str(ports["decode-0"])], tmp_path / "decode-0.log"
        )
        stack.callback(stop_process, decode)
        frontend, _ = start_frontend(stack, plane_args, tmp_path, 2, "--disaggregation", "always")
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        cluster = Cluster(frontend, urls)
        _, usage, finish = streamed_completion(cluster.client, "mocker", PROMPT, 6, seed=7)
        assert (usage.completion_tokens, finish) == (6, "length")
        assert cluster.frontend_metric("weir_frontend_disagg_handover_seconds_count", 'model="mocker"') == 1
        for worker, direction in (("decode-0", "pulled"), ("prefill-0", "served")):

            def moved(name: str, labels: str, worker: str = worker, direction: str = direction) -> float:
                text = httpx.get(f"{urls[worker]}/metrics", timeout=5).text
                return metric(text, name, f'worker="{worker}",direction="{direction}",{labels}')

            log = (tmp_path / f"{worker}.log").read_text()[-2000:]
            assert moved("weir_worker_kv_transfer_bytes_total", 'transport="mooncake"') > 0, (worker, log)
            assert moved("weir_worker_kv_transfer_bytes_total", 'transport="tcp"') == 0
            assert moved("weir_worker_kv_transfers_total", 'outcome="ok"') == 1


def test_the_transport_is_named_in_help_and_refused_when_unknown() -> None:
    assert "--kv-transport" in weir("worker", "--help").stdout
    result = weir("worker", "--backend", "mocker", "--kv-transport", "carrier-pigeon", timeout=30)
    assert result.returncode == 2 and "--kv-transport: invalid choice" in result.stderr
