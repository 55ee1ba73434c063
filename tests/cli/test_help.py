"""`weir --help` and every subcommand's --help work and document their environment variables.

One test runs the real entry point in a subprocess; the rest parse in-process (the same
`main()`), which keeps the suite fast."""

from __future__ import annotations

import importlib.util

import pytest

from orchestrator.cli.main import COMMANDS, build_parser, main
from tests.cli.procs import weir


def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_command() -> None:
    result = weir("--help")
    assert result.returncode == 0, result.stderr
    for name in COMMANDS:
        assert name in result.stdout


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "serve" in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_subcommand_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = COMMANDS[command][0]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not in this tree yet")
    assert help_text(capsys, command).startswith(f"usage: weir {command}")


@pytest.mark.parametrize(
    ("command", "variables"),
    [
        (
            "serve",
            [
                "WEIR_HOST",
                "WEIR_PORT",
                "WEIR_WORKERS",
                "WEIR_BACKEND",
                "WEIR_MODEL",
                "WEIR_LOG_LEVEL",
                "WEIR_API_KEY",
            ],
        ),
        (
            "frontend",
            [
                "WEIR_HOST",
                "WEIR_PORT",
                "WEIR_ROUTER_MODE",
                "WEIR_ROUTER_ADDRESS",
                "WEIR_ETCD",
                "WEIR_NATS",
                "WEIR_NAMESPACE",
                "WEIR_API_KEY",
            ],
        ),
        ("worker", ["WEIR_BACKEND", "WEIR_MODEL", "WEIR_ROLE", "WEIR_ETCD", "WEIR_NATS", "WEIR_LEASE_TTL"]),
        (
            "router",
            [
                "WEIR_ROUTER_HOST",
                "WEIR_ROUTER_PORT",
                "WEIR_METRICS_PORT",
                "WEIR_ROUTER_MODE",
                "WEIR_ETCD",
                "WEIR_NATS",
            ],
        ),
    ],
)
def test_serving_commands_document_their_environment(
    command: str, variables: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    text = " ".join(help_text(capsys, command).split())  # argparse wraps lines
    for variable in variables:
        assert f"env {variable}" in text, f"{command} --help does not mention {variable}"


def test_environment_sets_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.cli.main import build_parser

    monkeypatch.setenv("WEIR_ETCD", "http://etcd.example:2379")
    monkeypatch.setenv("WEIR_LEASE_TTL", "3.5")
    args = build_parser(only="worker").parse_args(["worker", "--nats", "nats://flag:4222"])
    assert (args.etcd, args.lease_ttl, args.nats) == ("http://etcd.example:2379", 3.5, "nats://flag:4222")


def test_bad_flag_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--backend", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_missing_model_directory_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--backend", "mocker", "--model", "/nonexistent/model"]) == 2
    assert "neither a directory" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "frontend"])
def test_api_key_flag_wins_over_the_environment(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.cli.frontend import frontend_config

    monkeypatch.setenv("WEIR_API_KEY", "from-env")
    args = build_parser(only=command).parse_args([command])
    assert frontend_config(args, "ns").api_key == "from-env"
    args = build_parser(only=command).parse_args([command, "--api-key", "from-flag"])
    assert frontend_config(args, "ns").api_key == "from-flag"
    monkeypatch.delenv("WEIR_API_KEY")
    assert frontend_config(build_parser(only=command).parse_args([command]), "ns").api_key is None


def test_remote_routing_needs_a_router_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.cli.frontend import frontend_config

    monkeypatch.delenv("WEIR_ROUTER_ADDRESS", raising=False)
    args = build_parser(only="frontend").parse_args(["frontend", "--router-mode", "remote"])
    with pytest.raises(SystemExit, match="router address"):
        frontend_config(args, "ns")
    args = build_parser(only="frontend").parse_args(
        ["frontend", "--router-mode", "remote", "--router-address", "router:9100"]
    )
    assert frontend_config(args, "ns").router_address == "router:9100"


def test_router_rejects_bad_router_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["router", "--router-mode", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_serve_refuses_remote_routing(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--router-mode", "remote", "--router-address", "127.0.0.1:9100"]
    assert main(argv) == 2
    assert "needs a cluster" in capsys.readouterr().err
