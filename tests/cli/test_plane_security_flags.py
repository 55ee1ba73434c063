"""The request-plane security flags parse into the PlaneSecurity the processes use."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli.main import build_parser
from orchestrator.cli.options import plane_security
from tests.certs import make_certs


def test_service_flags_set_limits_secret_file_and_tls(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-a-mounted-secret-file\n")
    for command in ("worker", "router"):
        args = build_parser(command).parse_args(
            [command, "--cluster-secret-file", str(secret_file), "--max-frame-bytes", "1000",
             "--max-connections", "5", "--max-connections-per-peer", "2",
             "--tls-cert", str(certs.cert), "--tls-key", str(certs.key), "--tls-ca", str(certs.ca)]
        )  # fmt: skip
        security = plane_security(args, serving=True)
        assert security.secret == b"from-a-mounted-secret-file"
        assert (security.max_frame_bytes, security.max_connections, security.max_connections_per_peer) == (
            1000,
            5,
            2,
        )
        assert security.server_tls is not None and security.client_tls is not None


def test_the_secret_comes_from_the_environment_and_a_frontend_only_dials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WEIR_CLUSTER_SECRET", "from-the-environment-0")
    args = build_parser("frontend").parse_args(["frontend", "--max-connections", "7"])
    security = plane_security(args, serving=False)
    assert security.secret == b"from-the-environment-0"
    assert security.max_connections != 7  # the frontend's --max-connections is its HTTP limit
    assert security.server_tls is None and security.client_tls is None


@pytest.mark.parametrize(
    "flags", [["--cluster-secret", "short"], ["--tls-cert", "c.pem"], ["--max-frame-bytes", "0"]]
)
def test_bad_settings_stop_the_command(flags: list[str]) -> None:
    args = build_parser("worker").parse_args(["worker", *flags])
    with pytest.raises(SystemExit):
        plane_security(args, serving=True)
