"""`weir --help` and every subcommand's --help work and document their environment variables."""

from __future__ import annotations

import importlib.util

import pytest

from orchestrator.cli.main import COMMANDS
from tests.cli.procs import weir


def test_top_level_help_lists_every_command() -> None:
    result = weir("--help")
    assert result.returncode == 0, result.stderr
    for name in COMMANDS:
        assert name in result.stdout


def test_no_command_prints_help_and_fails() -> None:
    result = weir()
    assert result.returncode == 2
    assert "serve" in result.stdout


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_subcommand_help(command: str) -> None:
    module = COMMANDS[command][0]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not in this tree yet")
    result = weir(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: weir {command}")


@pytest.mark.parametrize(
    ("command", "variables"),
    [
        ("serve", ["WEIR_HOST", "WEIR_PORT", "WEIR_WORKERS", "WEIR_BACKEND", "WEIR_MODEL", "WEIR_LOG_LEVEL"]),
        (
            "frontend",
            ["WEIR_HOST", "WEIR_PORT", "WEIR_ROUTER_MODE", "WEIR_ETCD", "WEIR_NATS", "WEIR_NAMESPACE"],
        ),
        ("worker", ["WEIR_BACKEND", "WEIR_MODEL", "WEIR_ROLE", "WEIR_ETCD", "WEIR_NATS", "WEIR_LEASE_TTL"]),
    ],
)
def test_serving_commands_document_their_environment(command: str, variables: list[str]) -> None:
    # argparse wraps help text, so compare without line breaks.
    text = " ".join(weir(command, "--help").stdout.split())
    for variable in variables:
        assert f"env {variable}" in text, f"{command} --help does not mention {variable}"


def test_bad_flag_value_is_a_usage_error() -> None:
    result = weir("serve", "--backend", "nope")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_missing_model_directory_is_a_clear_error() -> None:
    result = weir("serve", "--backend", "mocker", "--model", "/nonexistent/model")
    assert result.returncode == 2
    assert "neither a directory" in result.stderr
