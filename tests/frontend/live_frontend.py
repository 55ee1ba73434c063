"""A real frontend on a 127.0.0.1 socket for tests: uvicorn (uvloop + httptools) in a thread,
in-process mocker workers announced through in-process discovery, as `weir serve` wires them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
import uvloop
from tokenizers import Tokenizer

from backends.mocker.config import MockerConfig
from backends.mocker.engine import MockerEngine
from orchestrator.frontend.config import FrontendConfig
from orchestrator.frontend.server import create_app, uvicorn_config
from orchestrator.runtime.discovery import MemoryDiscovery
from orchestrator.runtime.engine import Engine
from orchestrator.runtime.events import MemoryEventPlane
from orchestrator.runtime.model_files import eos_token_ids
from orchestrator.runtime.worker_host import WorkerHost
from tests.servers import free_port
from tests.waiting import wait_http_ok

T = TypeVar("T")
MODEL = "mock-model"


@dataclass
class LiveFrontend:
    url: str
    loop: asyncio.AbstractEventLoop
    discovery: MemoryDiscovery
    engines: dict[str, Engine]
    hosts: dict[str, WorkerHost]
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
    # The tokenizer's EOS ids, as `weir serve` gives the mocker: ordinary tokens never hit the
    # ids the frontend stops on, so only the drawn length or max_tokens ends a request.
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = MockerConfig(
        model_name=MODEL,
        model_path=str(model_dir),
        speedup=speedup,
        vocab_size=400,
        context_length=4096,
        eos_token_ids=eos_token_ids(model_dir, tokenizer),
    )
    return lambda: MockerEngine(config)


@contextmanager
def live_frontend(
    model_dir: Path,
    num_workers: int = 2,
    speedup: float = 1000.0,
    engine_factory: Callable[[], Engine] | None = None,
    tcp: bool = False,
    **config: Any,
) -> Iterator[LiveFrontend]:
    """Mocker workers by default; `engine_factory` serves any other engine instead.

    In-process calls by default; with `tcp`, each engine sits behind a `WorkerHost` on the TCP
    request plane and publishes KV events and load reports on an in-process event plane."""
    make_engine = engine_factory or mocker_factory(model_dir, speedup)
    port = free_port()
    frontend_config = FrontendConfig(port=port, **config)
    started: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        namespace = frontend_config.namespace
        discovery = MemoryDiscovery(namespace)
        events = MemoryEventPlane()
        engines = {f"worker-{i}": make_engine() for i in range(num_workers)}
        hosts = {
            worker_id: WorkerHost(engine, discovery, events, namespace, instance_id=worker_id)
            for worker_id, engine in engines.items()
        }
        # Without tcp the frontend calls the hosts in process, as `weir serve` does.
        local: dict[str, WorkerHost] = {} if tcp else hosts
        app = create_app(frontend_config, discovery, events if tcp else None, local)
        server = uvicorn.Server(uvicorn_config(app, frontend_config))
        started.update(
            loop=asyncio.get_running_loop(), discovery=discovery, engines=engines, hosts=hosts, server=server
        )
        serving = asyncio.create_task(server.serve())
        # Announced after the app is up, so the frontend learns them through its discovery watch.
        for host in hosts.values():
            await host.start()  # registers itself
        ready.set()
        try:
            await serving
        finally:
            for host in hosts.values():
                await host.stop()
            await discovery.close()
            await events.close()

    thread = threading.Thread(target=uvloop.run, args=(main(),), name="live-frontend", daemon=True)
    thread.start()
    if not ready.wait(30):
        raise TimeoutError("frontend did not start")
    live = LiveFrontend(f"http://127.0.0.1:{port}", thread=thread, **started)
    wait_http_ok(f"{live.url}/health")
    try:
        yield live
    finally:
        live.server.should_exit = True
        thread.join(15)
