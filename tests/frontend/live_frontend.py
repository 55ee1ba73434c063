"""A real frontend on a 127.0.0.1 socket for tests: uvicorn (uvloop + httptools) in a thread,
in-process mocker workers announced through in-process discovery, as `weir serve` wires them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
import uvloop

from backends.mocker.config import MockerConfig
from backends.mocker.engine import MockerEngine
from orchestrator.frontend.config import FrontendConfig
from orchestrator.frontend.server import create_app, uvicorn_config
from orchestrator.runtime.discovery import MemoryDiscovery
from orchestrator.runtime.engine import Engine
from orchestrator.runtime.protocol import Instance
from orchestrator.runtime.request_plane import LocalWorkerClient
from tests.servers import free_port

T = TypeVar("T")
MODEL = "mock-model"


@dataclass
class LiveFrontend:
    url: str
    loop: asyncio.AbstractEventLoop
    discovery: MemoryDiscovery
    engines: dict[str, Engine]
    server: uvicorn.Server
    thread: threading.Thread = field(repr=False)

    def call(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: float = 10.0) -> T:
        """Run a coroutine on the server's loop (engines and discovery live there)."""
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout)

    def active_requests(self) -> int:
        async def count() -> int:
            return sum(e.load().active_requests + e.load().waiting_requests for e in self.engines.values())

        return self.call(count)


def mocker_factory(model_dir: Path, speedup: float = 1000.0) -> Callable[[], Engine]:
    config = MockerConfig(
        model_name=MODEL, model_path=str(model_dir), speedup=speedup, vocab_size=400, context_length=4096
    )
    return lambda: MockerEngine(config)


@contextmanager
def live_frontend(
    model_dir: Path,
    num_workers: int = 2,
    speedup: float = 1000.0,
    engine_factory: Callable[[], Engine] | None = None,
    **config: Any,
) -> Iterator[LiveFrontend]:
    """Mocker workers by default; `engine_factory` serves any other engine instead."""
    make_engine = engine_factory or mocker_factory(model_dir, speedup)
    port = free_port()
    frontend_config = FrontendConfig(port=port, **config)
    started: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        discovery = MemoryDiscovery()
        engines = {f"worker-{i}": make_engine() for i in range(num_workers)}
        for engine in engines.values():
            await engine.start()
        local = {worker_id: LocalWorkerClient(engine) for worker_id, engine in engines.items()}
        server = uvicorn.Server(
            uvicorn_config(create_app(frontend_config, discovery, None, local), frontend_config)
        )
        started.update(loop=asyncio.get_running_loop(), discovery=discovery, engines=engines, server=server)
        serving = asyncio.create_task(server.serve())
        # Announced after the app is up, so the frontend learns them through its discovery watch.
        for worker_id, engine in engines.items():
            await discovery.register(Instance(instance_id=worker_id, component="worker", card=engine.card))
        ready.set()
        try:
            await serving
        finally:
            for engine in engines.values():
                await engine.stop()
            await discovery.close()

    thread = threading.Thread(target=uvloop.run, args=(main(),), name="live-frontend", daemon=True)
    thread.start()
    if not ready.wait(30):
        raise TimeoutError("frontend did not start")
    live = LiveFrontend(f"http://127.0.0.1:{port}", thread=thread, **started)
    _wait_healthy(live.url)
    try:
        yield live
    finally:
        live.server.should_exit = True
        thread.join(15)


def _wait_healthy(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url}/health never became 200")
