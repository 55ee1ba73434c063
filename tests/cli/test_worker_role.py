"""`weir worker --role`: a role no router serves is refused at start, before the worker could
register in discovery and look healthy while nobody routes to it."""

from __future__ import annotations

import pytest

from tests.cli.procs import weir
from tests.cluster import planes


@pytest.mark.parametrize(
    ("flags", "env_role"),
    [(["--role", "prefill"], None), (["--role", "decode"], None), ([], "decode")],
    ids=["prefill", "decode", "WEIR_ROLE=decode"],
)
def test_unrouted_role_is_refused_at_start(
    etcd_url: str, nats_url: str, flags: list[str], env_role: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env_role is not None:
        monkeypatch.setenv("WEIR_ROLE", env_role)
    # Real planes: without the refusal the worker would start, register and keep running, and
    # this call would time out instead of returning.
    result = weir("worker", "--backend", "mocker", *flags, *planes(etcd_url, nats_url, "role"), timeout=30)
    role = env_role or flags[1]
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"weir worker: --role {role} is not served: routers route only aggregated workers; "
        "prefill/decode are not routed yet"
    ]
