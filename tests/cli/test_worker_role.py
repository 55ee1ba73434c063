"""`weir worker --role`: prefill and decode workers register under their role, which `weir
status` shows; a role that does not exist is refused by the parser."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

from tests.cli.procs import weir, weir_process
from tests.cluster import planes
from tests.waiting import wait_until


def test_prefill_and_decode_workers_register_under_their_role(
    etcd_url: str, nats_url: str, tmp_path: Path
) -> None:
    plane_args = planes(etcd_url, nats_url, "role")
    namespace = plane_args[plane_args.index("--weir-namespace") + 1]
    with ExitStack() as stack:
        for name, role in (("p-0", "prefill"), ("d-0", "decode")):
            stack.enter_context(
                weir_process(
                    "worker",
                    *("--backend", "mocker", "--role", role, "--instance-id", name),
                    *plane_args,
                    log=tmp_path / f"{name}.log",
                )
            )
        status = ["status", "--etcd", etcd_url, "--weir-namespace", namespace, "--no-kubernetes"]
        roles: dict[str, str] = {}

        def listed() -> bool:
            result = weir(*status, "--load-window", "0", "-o", "json")
            roles.update({w["instance_id"]: w["role"] for w in json.loads(result.stdout)["workers"]})
            return len(roles) == 2

        wait_until(listed, "both workers in weir status", 60)
        assert roles == {"p-0": "prefill", "d-0": "decode"}
        table = weir(*status, "--load-window", "0").stdout.splitlines()
        assert any(line.startswith("p-0") and " prefill " in line for line in table), table


def test_an_unknown_role_is_refused() -> None:
    result = weir("worker", "--backend", "mocker", "--role", "encode", timeout=30)
    assert result.returncode == 2
    assert "--role: invalid choice: 'encode'" in result.stderr
