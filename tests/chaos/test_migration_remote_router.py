"""Request migration behind the standalone router: two `weir worker --backend mocker` processes,
one `weir router` and `weir frontend --router-mode remote` over real etcd and NATS. 24 seeded
streaming requests of 200 tokens at concurrency 8; once streams run on both workers, one is
SIGKILLed. Every request must finish, 200 tokens and finish_reason length, each token for token
what the same request gave with no kill: the frontend migrates the streams the dead worker held,
though the router, not the frontend, picks the workers."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from backends.registry import DEFAULT_MODEL
from tests.chaos.test_worker_death import Result, complete, migrations_counted, outcomes
from tests.cli.procs import wait_healthy, weir_process
from tests.cluster import LEASE_TTL, Cluster, metric, planes, start_frontend, start_workers
from tests.servers import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

WORKERS = ("worker-a", "worker-b")
REQUESTS = 24
CONCURRENCY = 8
TOKENS = 200


def run_all(client: openai.OpenAI, done: list[int] | None = None) -> dict[int, Result]:
    results: dict[int, Result] = {}
    done = [] if done is None else done

    def one(i: int) -> None:
        try:
            results[i] = complete(client, i)
        except Exception as exc:  # counted as a failure below, with its message
            results[i] = exc
        done.append(i)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(one, range(REQUESTS)))
    return results


def test_a_worker_killed_mid_stream_behind_the_remote_router_loses_no_request(
    etcd_url: str, nats_url: str, tmp_path: Path
) -> None:
    plane_args = planes(etcd_url, nats_url, "chaos-rr")
    router_port, router_metrics_port = free_port(), free_port()
    router_url = f"http://127.0.0.1:{router_metrics_port}"
    labels = f'model="{DEFAULT_MODEL}"'

    def router_metric(name: str, labels: str) -> float:
        return metric(httpx.get(f"{router_url}/metrics", timeout=5).text, name, labels)

    with ExitStack() as stack:
        # Speedup 1: a decode step takes ~6 ms, so 200 tokens take over a second and the kill
        # lands mid-stream.
        procs, metrics = start_workers(stack, plane_args, tmp_path, WORKERS, speedup=1.0)
        log = tmp_path / "router.log"
        router = stack.enter_context(
            weir_process(
                "router",
                *plane_args,
                *("--port", str(router_port), "--metrics-port", str(router_metrics_port)),
                *("--instance-id", "router", "--lease-ttl", str(LEASE_TTL), "--log-level", "info"),
                log=log,
            )
        )
        wait_healthy(router_url, router, log)
        wait_until(
            lambda: router_metric("weir_router_workers", labels) >= len(WORKERS),
            "the router to see both workers",
            60,
            proc=router,
            log=log,
        )
        address = ("--router-mode", "remote", "--router-address", f"127.0.0.1:{router_port}")
        url, _ = start_frontend(stack, plane_args, tmp_path, len(WORKERS), *address)
        c = Cluster(url, metrics)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        # The same requests with no kill: what every completion must equal.
        reference = run_all(client)
        assert all(isinstance(r, tuple) for r in reference.values()), f"the no-kill run failed: {reference}"
        assert len({r[0] for r in reference.values() if isinstance(r, tuple)}) == REQUESTS  # seeds matter
        decisions_before = router_metric("weir_router_decisions_total", f'{labels},mode="kv"')
        assert decisions_before >= REQUESTS  # the router placed them, not the frontend

        def in_flight(worker: str) -> float:
            text = httpx.get(f"{metrics[worker]}/metrics", timeout=5).text
            return metric(text, "weir_worker_in_flight_requests", f'worker="{worker}"')

        done: list[int] = []
        killed_at: list[float] = []
        started = time.monotonic()

        def killer() -> None:
            # A first stream has finished, so the others have sent tokens, and both workers hold some.
            wait_until(
                lambda: bool(done) and all(in_flight(w) > 0 for w in WORKERS), "streams on both workers", 30
            )
            procs[WORKERS[0]].send_signal(signal.SIGKILL)
            killed_at.append(time.monotonic() - started)

        thread = threading.Thread(target=killer)
        thread.start()
        results = run_all(client, done)
        elapsed = time.monotonic() - started
        thread.join()
        assert killed_at, "the worker was never killed"

        failures, short, different = outcomes(results, reference, TOKENS)
        wait_until(lambda: c.known_workers() == 1, "the killed worker's lease to expire", 30)
        migrations = migrations_counted(c)
        decisions = router_metric("weir_router_decisions_total", f'{labels},mode="kv"') - decisions_before
        print(
            json.dumps(
                {
                    "requests": REQUESTS,
                    "concurrency": CONCURRENCY,
                    "tokens": TOKENS,
                    "failures": len(failures),
                    "incomplete": len(short),
                    "different_from_no_kill": len(different),
                    "migrations": migrations,
                    "router_decisions": decisions,
                    "killed_at_s": round(killed_at[0], 2),
                    "elapsed_s": round(elapsed, 2),
                }
            )
        )
        assert not failures, f"{len(failures)} failed, e.g. {next(iter(failures.values()))!r}"
        assert not short, f"{len(short)} streams incomplete, e.g. {results[short[0]]!r}"
        assert not different, f"{len(different)} completions differ from the no-kill run"
        assert migrations > 0  # the kill did land mid-stream
