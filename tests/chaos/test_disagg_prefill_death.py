"""A prefill worker SIGKILLed while discovery still lists it (its lease has not expired): a
disaggregated request sent to it finds the connection refused before its first token and is
served whole by the decode worker, token for token what the disaggregated path gave. Separate
`weir worker --role prefill|decode` processes and `weir frontend --disaggregation always`
over real etcd and NATS."""

from __future__ import annotations

import signal
from contextlib import ExitStack
from pathlib import Path

import openai

from backends.registry import DEFAULT_MODEL
from tests.cli.procs import weir_process
from tests.cluster import Cluster, planes, start_frontend
from tests.completions import streamed_completion

PROMPT = "tell me about the river " * 12
LEASE_TTL_S = "30"  # the killed worker stays in discovery for the whole test


def complete(client: openai.OpenAI) -> str:
    text, usage, _ = streamed_completion(client, DEFAULT_MODEL, PROMPT, 12, seed=11)
    assert usage.completion_tokens == 12
    return text


def test_a_killed_prefill_worker_falls_back_to_the_decode_worker(
    etcd_url: str, nats_url: str, tmp_path: Path
) -> None:
    plane_args = planes(etcd_url, nats_url, "disagg-kill")
    with ExitStack() as stack:
        procs = {
            role: stack.enter_context(
                weir_process(
                    "worker",
                    *("--backend", "mocker", "--speedup", "1000", "--block-size", "16", "--role", role),
                    *("--instance-id", f"{role}-0", "--lease-ttl", LEASE_TTL_S),
                    *plane_args,
                    log=tmp_path / f"{role}.log",
                )
            )
            for role in ("prefill", "decode")
        }
        url, _ = start_frontend(stack, plane_args, tmp_path, 2, "--disaggregation", "always")
        c = Cluster(url, {})
        outcome = f'model="{DEFAULT_MODEL}",outcome='
        disaggregated = complete(c.client)
        assert c.frontend_metric("weir_frontend_disagg_decisions_total", outcome + '"disaggregated"') == 1

        procs["prefill"].send_signal(signal.SIGKILL)
        procs["prefill"].wait(10)
        assert complete(c.client) == disaggregated
        reason = f'model="{DEFAULT_MODEL}",reason="unavailable"'
        assert c.frontend_metric("weir_frontend_disagg_fallbacks_total", reason) == 1
        assert c.frontend_metric("weir_frontend_disagg_decisions_total", outcome + '"fallback"') == 1
        assert c.frontend_metric("weir_frontend_circuit_breaker_trips_total", f'model="{DEFAULT_MODEL}"') == 1
        # With its breaker open the dead worker is no candidate: the next one is served whole
        # by the policy (or, past the back-off, probes it and falls back again); it completes.
        assert complete(c.client) == disaggregated
        assert c.known_workers() == 2  # all of this inside the dead worker's lease
