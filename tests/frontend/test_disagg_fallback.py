"""A disaggregated request whose prefill worker refuses it (it has begun to drain, and
discovery has not told the frontend yet) is served whole by the decode worker: the caller gets
its whole completion, token-identical to a disaggregated one, and the frontend counts a
fallback by the refusal's code. Once the drain reaches discovery, the prefill pool is empty of
candidates and requests are served whole by the policy, not by a fallback."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from orchestrator.cli.worker import WithRole
from orchestrator.runtime.engine import Engine
from orchestrator.runtime.protocol import Role
from router.disagg import DisaggPolicy
from tests.cluster import metric
from tests.frontend.live_frontend import MODEL, LiveFrontend, live_frontend, mocker_factory
from tests.frontend.tokenizer_dirs import build_chatml
from tests.waiting import wait_until

PROMPT = "tell me about the river " * 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chatml(tmp_path_factory.mktemp("chatml"))


def with_roles(make: Callable[[], Engine], roles: list[Role]) -> Callable[[], Engine]:
    """Engines from `make`, registered under `roles` in turn (worker-0 gets the first)."""
    pending = iter(roles)
    return lambda: WithRole(make(), next(pending))


@pytest.fixture
def live(model_dir: Path) -> Iterator[LiveFrontend]:
    factory = with_roles(mocker_factory(model_dir), ["prefill", "decode"])
    with live_frontend(
        model_dir, num_workers=2, engine_factory=factory, disaggregation=DisaggPolicy("always")
    ) as live:
        yield live


def counted(live: LiveFrontend, name: str, labels: str) -> float:
    return metric(httpx.get(f"{live.url}/metrics", timeout=5).text, name, labels)


def complete(client: openai.OpenAI) -> str:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, seed=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert out.choices[0].finish_reason == "length"
    return out.choices[0].text


def test_a_refused_prefill_falls_back_to_a_whole_request(
    live: LiveFrontend, caplog: pytest.LogCaptureFixture
) -> None:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)
    with caplog.at_level(logging.DEBUG, logger="weir.frontend"):
        disaggregated = complete(client)
    # The decision's inputs, at debug level only: both pools' best candidates.
    decided = [r.getMessage() for r in caplog.records if r.getMessage().startswith("disagg ")]
    assert len(decided) == 1
    assert re.fullmatch(
        r"disagg \S+ -> prefill \(always\) prompt=\d+ whole=Candidate\(uncached_tokens=\d+, "
        r"queued_tokens=\d+\) prefill=Candidate\(uncached_tokens=\d+, queued_tokens=\d+\)",
        decided[0],
    ), decided
    assert (
        counted(live, "weir_frontend_disagg_decisions_total", f'model="{MODEL}",outcome="disaggregated"') == 1
    )
    prefill = live.hosts["worker-0"]

    async def begin_drain() -> None:  # drain's first step, before discovery hears of it
        prefill.draining = True

    live.call(begin_drain)
    assert complete(client) == disaggregated
    fallback = f'model="{MODEL}",reason="overloaded"'
    assert counted(live, "weir_frontend_disagg_fallbacks_total", fallback) == 1
    assert counted(live, "weir_frontend_disagg_decisions_total", f'model="{MODEL}",outcome="fallback"') == 1
    # A refusal is no migration of a request that streamed: the migration count stays 0.
    assert counted(live, "weir_frontend_migrations_total", f'model="{MODEL}",reason="overloaded"') == 0

    live.call(prefill.drain)  # now discovery says so, and the prefill pool has no candidate

    def served_whole_by_the_policy() -> bool:
        assert complete(client) == disaggregated  # each request completes, fallback or not
        aggregated = f'model="{MODEL}",outcome="aggregated"'
        return counted(live, "weir_frontend_disagg_decisions_total", aggregated) >= 1

    wait_until(served_whole_by_the_policy, "a request served whole by the policy", 10)
