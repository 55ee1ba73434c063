"""The frontend with workers behind `WorkerHost`s: TCP request plane, KV events and load
reports on the event plane feeding the KV router, and a worker lost in the middle of a stream."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.frontend.live_frontend import MODEL, live_frontend
from tests.frontend.tokenizer_dirs import build_chatml
from tests.waiting import wait_until

FIXED = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chatml(tmp_path_factory.mktemp("chatml"))


def test_kv_events_steer_a_repeated_prefix_to_its_worker(model_dir: Path) -> None:
    # Weighted 2, a prefix hit outweighs the blocks of a request that just ended on its worker:
    # a load report from before its end may still stand when the next request is routed (the
    # 1:1 default then prices the warm worker above the cold one, as a busy CI machine showed).
    params = {"overlap_weight": 2.0}
    with live_frontend(model_dir, num_workers=2, tcp=True, router_mode="kv", router_params=params) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)
        prefix = "The scheduler batches prefill chunks and decode steps together. " * 20
        client.completions.create(model=MODEL, prompt=prefix + "First.", max_tokens=2, extra_body=FIXED)
        _wait_for_kv_events(live.url)
        cached = []
        for question in ("Second?", "Third!", "Fourth."):
            out = client.completions.create(
                model=MODEL, prompt=prefix + question, max_tokens=2, extra_body=FIXED
            )
            assert out.usage is not None and out.usage.prompt_tokens_details is not None
            cached.append(out.usage.prompt_tokens_details.cached_tokens or 0)
        # Every follow-up found the shared prefix's full blocks (all but the tail) cached.
        assert min(cached) >= 64 * 4


def _wait_for_kv_events(url: str, timeout: float = 10.0) -> None:
    """Until the router has applied KV events (workers publish them every ~15 ms)."""

    def applied() -> bool:
        lines = httpx.get(f"{url}/metrics").text.splitlines()
        prefix = "weir_router_kv_events_applied_total{"
        return any(line.startswith(prefix) and float(line.rsplit(" ", 1)[1]) > 0 for line in lines)

    wait_until(applied, "the router to apply a KV event", timeout, interval=0.02)


def test_worker_lost_mid_stream_ends_the_stream_with_an_error(model_dir: Path) -> None:
    with live_frontend(model_dir, num_workers=1, speedup=1.0, tcp=True) as live:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        (host,) = live.hosts.values()
        events = []
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if len(events) == 1:
                    live.call(host.stop)
        assert '"error"' in events[-2]
        assert "unavailable" in events[-2]
        assert events[-1] == "data: [DONE]"
        # The frontend itself is fine; with its only worker gone it says so.
        assert httpx.get(f"{live.url}/health").status_code == 503
