"""`weir drain` against real etcd: the drain request lands where workers look for it, a worker
that never finishes makes it time out, and (when the worker command exists) a real mocker
worker behind a real frontend drains while a stream is in flight and the stream still ends well.

Nothing here writes `drained/<id>` on a worker's behalf: only a real worker does that."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cli.main import main
from orchestrator.runtime.discovery import drain_key, make_discovery
from orchestrator.runtime.protocol import Instance, ModelCard
from tests.servers import free_port, stop_process, wait_for_port

CARD = ModelCard(name="mock-model", role="decode", backend="mocker")


def drain_argv(etcd: str, namespace: str, worker: str, timeout: float) -> list[str]:
    return ["drain", worker, "--etcd", etcd, "--weir-namespace", namespace, "--drain-timeout", str(timeout)]


def test_unknown_worker(capsys: pytest.CaptureFixture[str], etcd_url: str) -> None:
    assert main(drain_argv(etcd_url, "drain-unknown", "nope", 1)) == 3
    assert "no worker 'nope' in discovery" in capsys.readouterr().err


async def test_stuck_worker_times_out_and_stays_draining(etcd_url: str) -> None:
    """A registered worker that never reports drained (as one with a stream that never ends)."""
    discovery = make_discovery(etcd_url, "drain-stuck")
    await discovery.register(
        Instance(instance_id="stuck", component="worker", address="127.0.0.1:1", card=CARD)
    )
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator.cli.main", *drain_argv(etcd_url, "drain-stuck", "stuck", 1.0),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 1, err.decode()
        assert "draining stuck: new requests go elsewhere" in out.decode()
        assert "stuck still had requests in flight after 1s" in err.decode()
        # The request stays, so the worker keeps refusing new work after the CLI gave up.
        assert await discovery.get(drain_key("stuck")) is not None
    finally:
        await discovery.close()


async def test_worker_that_exits_while_draining(etcd_url: str) -> None:
    discovery = make_discovery(etcd_url, "drain-exit")
    await discovery.register(
        Instance(instance_id="leaving", component="worker", address="127.0.0.1:1", card=CARD)
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator.cli.main", *drain_argv(etcd_url, "drain-exit", "leaving", 30),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    # Wait until the CLI has asked, then go away as a stopped worker's lease would.
    deadline = time.monotonic() + 30
    while await discovery.get(drain_key("leaving")) is None:
        assert time.monotonic() < deadline, "weir drain never wrote the drain key"
        await asyncio.sleep(0.1)
    await discovery.close()
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert "leaving left discovery before reporting drained" in out.decode()


# --------------------------------------------------------------------------- with a real worker

needs_worker = pytest.mark.skipif(
    importlib.util.find_spec("orchestrator.cli.worker") is None
    or importlib.util.find_spec("orchestrator.cli.frontend") is None,
    reason="`weir worker` / `weir frontend` are not in this tree yet (issue 2)",
)


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        argv = [sys.executable, "-m", "orchestrator.cli.main", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


@pytest.fixture
def cluster(etcd_url: str, nats_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """One mocker worker and one frontend as separate processes; yields (namespace, API URL)."""
    namespace = f"drain-{os.getpid()}"
    planes = ["--weir-namespace", namespace, "--etcd", etcd_url, "--nats", nats_url]
    api_port, worker_port, metrics_port = free_port(), free_port(), free_port()
    worker = _spawn(["worker", "--backend", "mocker", "--role", "aggregated",
                     "--model", "smollm2-135m-instruct", "--served-model-name", "mock-model",
                     "--host", "127.0.0.1", "--port", str(worker_port), "--metrics-port", str(metrics_port),
                     "--speedup", "1", *planes], tmp_path / "worker.log")  # fmt: skip
    frontend = _spawn(["frontend", "--host", "127.0.0.1", "--port", str(api_port),
                       "--router-mode", "round-robin", *planes], tmp_path / "frontend.log")  # fmt: skip
    try:
        wait_for_port(api_port, timeout=60, proc=frontend)
        yield namespace, f"http://127.0.0.1:{api_port}/v1"
    finally:
        stop_process(frontend)
        stop_process(worker)


@needs_worker
@pytest.mark.slow
async def test_drain_waits_for_the_stream_in_flight(etcd_url: str, cluster: tuple[str, str]) -> None:
    from openai import AsyncOpenAI

    namespace, base_url = cluster
    discovery = make_discovery(etcd_url, namespace)
    try:
        deadline = time.monotonic() + 60
        while not (workers := await discovery.list("worker")):
            assert time.monotonic() < deadline, "the worker never registered"
            await asyncio.sleep(0.2)
        worker_id = workers[0].instance_id
        client = AsyncOpenAI(base_url=base_url, api_key="none")
        deadline = time.monotonic() + 60
        while not (await client.models.list()).data:
            assert time.monotonic() < deadline, "the frontend never saw the model"
            await asyncio.sleep(0.2)

        stream = await client.completions.create(
            model="mock-model", prompt="hello " * 64, max_tokens=800, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokens, finish, stream_ended = 0, None, 0.0

        async def consume() -> None:
            nonlocal tokens, finish, stream_ended
            async for chunk in stream:
                tokens += 1
                finish = chunk.choices[0].finish_reason or finish
            stream_ended = time.monotonic()

        consumer = asyncio.create_task(consume())
        while tokens == 0:
            await asyncio.sleep(0.01)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator.cli.main", *drain_argv(etcd_url, namespace, worker_id, 120),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        communicate = asyncio.create_task(proc.communicate())
        while await discovery.get(drain_key(worker_id)) is None:
            await asyncio.sleep(0.02)
        assert not consumer.done(), "the stream ended before the drain was asked: nothing was tested"
        out, err = await asyncio.wait_for(communicate, 150)
        drain_ended = time.monotonic()
        await consumer
        assert proc.returncode == 0, err.decode()
        assert f"{worker_id} drained after" in out.decode()
        # The stream in flight finished in full, and before the worker called itself drained.
        assert finish == "length"
        assert stream_ended <= drain_ended
        advertised = {w.instance_id: w for w in await discovery.list("worker")}[worker_id]
        assert advertised.draining
    finally:
        await discovery.close()
