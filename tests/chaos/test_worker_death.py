"""Issue 9's chaos test: three `weir worker --backend mocker` processes over real etcd and NATS
behind `weir frontend`; 300 seeded streaming requests of 200 tokens at concurrency 24, two
workers SIGKILLed a few seconds apart while they run. Every request must finish, 200 tokens
and finish_reason length, each token for token what the same request gave with no kill:
request migration continues a stream on another worker after the tokens already sent."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from backends.registry import DEFAULT_MODEL
from tests.cluster import Cluster, planes, start_frontend, start_workers
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

WORKERS = ("worker-a", "worker-b", "worker-c")
REQUESTS = 300
CONCURRENCY = 24
TOKENS = 200
KILL_GAP_S = 2.5  # between the two kills (the issue asks for within 5 s)
Result = tuple[str, int, str | None] | BaseException  # (text, completion tokens, finish) or the error


def complete(client: openai.OpenAI, i: int) -> tuple[str, int, str | None]:
    """Request i streamed to the end: its text, completion tokens and finish reason."""
    stream = client.completions.create(
        model=DEFAULT_MODEL,
        prompt=f"request {i}: tell me a story",
        max_tokens=TOKENS,
        temperature=0.8,
        seed=1000 + i,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text: list[str] = []
    finish: str | None = None
    tokens = 0
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(text), tokens, finish


def run_all(
    client: openai.OpenAI, concurrency: int, done: list[int], on_progress: Callable[[], None] = lambda: None
) -> dict[int, Result]:
    results: dict[int, Result] = {}

    def one(i: int) -> None:
        try:
            results[i] = complete(client, i)
        except Exception as exc:  # counted as a failure below, with its message
            results[i] = exc
        done.append(i)
        on_progress()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(REQUESTS)))
    return results


def outcomes(
    results: dict[int, Result], reference: dict[int, Result], tokens: int
) -> tuple[dict[int, BaseException], list[int], list[int]]:
    """The requests that failed, that ended short of `tokens` (or not by length), and whose
    text differs from the same request's in the no-kill `reference`."""
    failures = {i: r for i, r in results.items() if isinstance(r, BaseException)}
    done = {i: r for i, r in results.items() if not isinstance(r, BaseException)}
    short = [i for i, r in done.items() if r[1:] != (tokens, "length")]
    different = [
        i for i, r in done.items() if not isinstance(ref := reference[i], BaseException) and r[0] != ref[0]
    ]
    return failures, short, different


def migrations_counted(c: Cluster) -> float:
    """The frontend's migrations, for every retryable reason."""
    return sum(
        c.frontend_metric("weir_frontend_migrations_total", f'model="{DEFAULT_MODEL}",reason="{reason}"')
        for reason in ("unavailable", "overloaded")
    )


def test_two_workers_killed_mid_stream_lose_no_request(etcd_url: str, nats_url: str, tmp_path: Path) -> None:
    plane_args = planes(etcd_url, nats_url, "chaos")
    with ExitStack() as stack:
        # Speedup 1: a decode step takes ~6 ms, so 200 tokens take over a second and kills land
        # mid-stream.
        procs, metrics = start_workers(stack, plane_args, tmp_path, WORKERS, speedup=1.0)
        url, _ = start_frontend(stack, plane_args, tmp_path, len(WORKERS))
        c = Cluster(url, metrics)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        # The same requests with no kill, all at once: what every completion must equal.
        reference = run_all(client, 100, [])
        assert all(isinstance(r, tuple) for r in reference.values()), "the no-kill run failed"
        assert len({r[0] for r in reference.values() if isinstance(r, tuple)}) == REQUESTS  # seeds matter

        done: list[int] = []
        first_done = threading.Event()
        started = time.monotonic()
        kills: list[float] = []

        def killer() -> None:
            first_done.wait(60)  # streams are running on every worker by then
            for name in WORKERS[:2]:
                procs[name].send_signal(signal.SIGKILL)
                kills.append(time.monotonic() - started)
                if len(kills) == 1:
                    threading.Event().wait(KILL_GAP_S)

        thread = threading.Thread(target=killer)
        thread.start()
        results = run_all(client, CONCURRENCY, done, lambda: len(done) >= CONCURRENCY and first_done.set())
        elapsed = time.monotonic() - started
        thread.join()
        assert len(kills) == 2 and kills[1] - kills[0] < 5.0
        assert len(done) == REQUESTS

        failures, short, different = outcomes(results, reference, TOKENS)
        wait_until(lambda: c.known_workers() == 1, "the killed workers' leases to expire", 30)
        migrations = migrations_counted(c)
        trips = c.frontend_metric("weir_frontend_circuit_breaker_trips_total", f'model="{DEFAULT_MODEL}"')
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
                    "breaker_trips": trips,
                    "kills_at_s": [round(k, 2) for k in kills],
                    "elapsed_s": round(elapsed, 2),
                }
            )
        )
        assert not failures, f"{len(failures)} failed, e.g. {next(iter(failures.values()))!r}"
        assert not short, f"{len(short)} streams incomplete, e.g. {results[short[0]]!r}"
        assert not different, f"{len(different)} completions differ from the no-kill run"
        assert migrations >= 2  # the kills did land mid-stream
        assert trips >= 2
