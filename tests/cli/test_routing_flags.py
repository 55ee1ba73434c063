"""Routing flags (--kv-tier-credits, the herding guard's): parsed, refused when malformed,
and carried to the router's cost model (the one `weir frontend`, `weir router` and
`weir replay` build)."""

from __future__ import annotations

import argparse

import pytest

from orchestrator.cli.options import add_router_arguments, router_params
from router.cost import CostParams
from router.policies.kv import KvPolicy
from router.router import make_router


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_router_arguments(parser, ("kv", "round-robin"), "kv")
    return parser.parse_args(list(argv))


def test_tier_credits_reach_the_cost_model_and_the_rest_keep_their_defaults() -> None:
    params = router_params(parse("--kv-tier-credits", "remote=0.4, host=1"))
    assert params == {"remote_credit": 0.4, "host_credit": 1.0}
    router = make_router("kv", 16, **params)
    assert isinstance(router.policy, KvPolicy)
    assert router.policy.params.tier_credits == {"host": 1.0, "disk": CostParams().disk_credit, "remote": 0.4}
    assert router_params(parse()) == {}


@pytest.mark.parametrize("value", ["device=0.5", "host", "host=x", "remote=1.5", "host=0.5,,"])
def test_a_malformed_credit_is_refused_at_parse_time(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--kv-tier-credits", value)
    assert "--kv-tier-credits" in capsys.readouterr().err


def test_the_herding_guard_flags_reach_the_cost_model_and_bad_values_are_refused() -> None:
    params = router_params(parse("--kv-balance-abs-requests", "0", "--kv-balance-rel", "2"))
    assert params == {"balance_abs_requests": 0, "balance_rel": 2.0}
    router = make_router("kv", 16, **params)
    assert isinstance(router.policy, KvPolicy)
    assert (router.policy.params.balance_abs_requests, router.policy.params.balance_rel) == (0, 2.0)
    bad = (("--kv-balance-rel", "0.5"), ("--kv-balance-abs-requests", "-1"), ("--kv-overlap-weight", "-1"))
    for argv in bad:
        with pytest.raises(SystemExit, match=r"^weir: .* must be"):
            router_params(parse(*argv))
