"""The disaggregation policy (router/disagg.py) on constructed loads and prompt lengths, and the
routing table's pools: prefill workers in a pool of their own, decode workers beside the
aggregated ones, prefill workers left out by a table that routes no prefills."""

from __future__ import annotations

import logging

import pytest

from orchestrator.runtime.discovery import DiscoveryEvent
from orchestrator.runtime.protocol import Instance, ModelCard, Role
from orchestrator.runtime.request_plane import WorkerClient
from router.disagg import Candidate, Choice, DisaggPolicy, best_candidate
from router.protocols import RouteRequest, WorkerLoad
from router.router import make_router
from router.table import ModelRoutes, RoutingTable

BLOCK = 16


def load(prefill_tokens: int = 0) -> WorkerLoad:
    w = WorkerLoad(queued_prefill_tokens=prefill_tokens)
    w.refresh()
    return w


# ---------------------------------------------------------------------- candidates


def test_the_best_candidate_has_the_least_prefill_work_ahead_of_its_first_token() -> None:
    loads = {"cold-idle": load(0), "warm-busy": load(3000), "warm-idle": load(100)}
    hits = {"warm-busy": 100, "warm-idle": 50}  # blocks of 16 tokens
    best = best_candidate(4000, BLOCK, hits, loads)
    # cold-idle: 0 + 4000; warm-busy: 3000 + 2400; warm-idle: 100 + 3200
    assert best == Candidate(uncached_tokens=3200, queued_tokens=100)
    assert best.predicted_tokens == 3300


def test_skipped_workers_are_no_candidates() -> None:
    loads = {"a": load(), "b": load()}
    assert best_candidate(100, BLOCK, {"a": 6}, loads, skip={"a"}) == Candidate(100, 0)
    assert best_candidate(100, BLOCK, {}, loads, skip={"a", "b"}) is None


def test_a_prompt_cached_past_its_length_computes_nothing() -> None:
    assert best_candidate(40, BLOCK, {"a": 3}, {"a": load()}) == Candidate(0, 0)


# ---------------------------------------------------------------------- the policy

LONG_COLD = Candidate(uncached_tokens=6000, queued_tokens=0)


@pytest.mark.parametrize(
    ("mode", "whole", "prefill", "decode_ready", "expected"),
    [
        ("never", LONG_COLD, LONG_COLD, True, (False, "never")),
        ("always", Candidate(10, 0), Candidate(10, 90_000), True, (True, "always")),
        ("always", LONG_COLD, None, True, (False, "no_prefill")),
        ("always", LONG_COLD, LONG_COLD, False, (False, "no_decode")),
        ("adaptive", LONG_COLD, LONG_COLD, True, (True, "pays")),
        ("adaptive", LONG_COLD, None, True, (False, "no_prefill")),
        ("adaptive", LONG_COLD, LONG_COLD, False, (False, "no_decode")),
        # no threshold by default: a short prompt moves too while the prefill pool is no busier
        ("adaptive", Candidate(100, 0), Candidate(100, 0), True, (True, "pays")),
        # the prefill pool is behind: the first token would come later there
        ("adaptive", Candidate(4000, 1000), Candidate(4000, 2000), True, (False, "prefill_busy")),
        # ...but a busy prefill pool still pays when the whole-request workers are busier
        ("adaptive", Candidate(4000, 9000), Candidate(4000, 2000), True, (True, "pays")),
        # the prefill pool caches more of the prompt: its first token comes sooner
        ("adaptive", Candidate(6000, 0), Candidate(1000, 4000), True, (True, "pays")),
    ],
)
def test_decide(
    mode: str,
    whole: Candidate | None,
    prefill: Candidate | None,
    decode_ready: bool,
    expected: tuple[bool, str],
) -> None:
    choice = DisaggPolicy(mode).decide(whole, prefill, decode_ready)  # type: ignore[arg-type]
    assert (choice.disaggregate, choice.reason) == expected


def test_the_threshold_is_a_setting() -> None:
    dynamo = DisaggPolicy("adaptive", min_uncached_tokens=2048)  # NVIDIA Dynamo's threshold
    assert dynamo.decide(Candidate(2047, 0), Candidate(2047, 0), True) == Choice(False, "short")
    assert dynamo.decide(Candidate(2048, 0), Candidate(2048, 0), True) == Choice(True, "pays")
    # short because the whole-request worker caches most of it, though the prefill pool does not
    assert dynamo.decide(Candidate(500, 0), Candidate(8000, 0), True) == Choice(False, "short")
    policy = DisaggPolicy("adaptive", min_uncached_tokens=100)
    assert policy.decide(Candidate(150, 0), Candidate(150, 0), True).disaggregate


@pytest.mark.parametrize("bad", [{"mode": "sometimes"}, {"min_uncached_tokens": -1}])
def test_bad_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"disaggregation mode|min_uncached_tokens"):
        DisaggPolicy(**bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- pools


class Table(RoutingTable[ModelRoutes]):
    """A routing table whose per-model value is its routes, as the standalone router's is."""

    async def _new_model(self, card: ModelCard, client: WorkerClient) -> ModelRoutes:
        return ModelRoutes(card.name, make_router("kv", card.block_size, model=card.name))

    def _routes(self, model: ModelRoutes) -> ModelRoutes:
        return model


class PrefillTable(Table):
    routes_prefill = True

    async def _new_prefill_pool(self, model: ModelRoutes, card: ModelCard) -> ModelRoutes:
        return ModelRoutes(card.name, make_router("kv", card.block_size, model=card.name))


def worker(instance_id: str, role: Role, draining: bool = False) -> DiscoveryEvent:
    card = ModelCard(name="m", block_size=BLOCK, role=role, total_kv_blocks=100)
    return DiscoveryEvent(
        "put", Instance(instance_id=instance_id, component="worker", card=card, draining=draining)
    )


def gone(instance_id: str) -> DiscoveryEvent:
    return DiscoveryEvent("delete", Instance(instance_id=instance_id, component="worker"))


def client_factory(instance: Instance) -> WorkerClient:
    return None  # type: ignore[return-value]  # these tests route, they never call a worker


async def test_pools_follow_discovery_by_role() -> None:
    table = PrefillTable(client_factory, logging.getLogger("test"))
    for event in (worker("p", "prefill"), worker("d", "decode"), worker("a", "aggregated")):
        await table.apply(event)
    routes = table.models["m"]
    assert routes.prefill is not None
    assert set(routes.prefill.workers) == {"p"}
    assert set(routes.workers) == {"d", "a"} and routes.decode_workers == {"d"}
    assert routes.decode_ready() and routes.decode_exclude() == ["a"]
    request = RouteRequest("r", 64)
    assert (await routes.select(request, routes.decode_exclude())).worker_id == "d"
    assert routes.prefill.candidate(request) == Candidate(64, 0)

    await table.apply(worker("d", "decode", draining=True))
    assert not routes.decode_ready()
    await table.apply(gone("p"))
    assert routes.prefill is None
    await table.apply(gone("d"))
    await table.apply(gone("a"))
    assert table.models == {}


async def test_a_model_with_only_prefill_workers_lives_until_the_last_goes() -> None:
    table = PrefillTable(client_factory, logging.getLogger("test"))
    await table.apply(worker("p", "prefill"))
    routes = table.models["m"]
    assert routes.workers == {} and routes.prefill is not None and not routes.decode_ready()
    await table.apply(gone("p"))
    assert table.models == {}


async def test_a_table_that_routes_no_prefills_leaves_prefill_workers_out() -> None:
    table = Table(client_factory, logging.getLogger("test"))
    await table.apply(worker("p", "prefill"))
    assert table.models == {} and table.worker_count == 0
    await table.apply(worker("d", "decode"))
    assert set(table.models["m"].workers) == {"d"} and table.models["m"].prefill is None
