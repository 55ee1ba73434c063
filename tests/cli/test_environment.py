"""Every flag of every command reads a WEIR_ environment variable named in its help; the flag
wins over the variable; a renamed flag keeps its old spelling, hidden, for one release;
`weir --version`."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
from collections import defaultdict

import pytest

from orchestrator.cli.main import COMMANDS, build_parser, main

# Flags no variable should set.
NO_VARIABLE = {"--help"}
NAMED = re.compile(r"\benv (WEIR_[A-Z0-9_]+)")


@pytest.fixture(autouse=True)
def no_weir_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in os.environ:
        if name.startswith("WEIR_"):
            monkeypatch.delenv(name)


def command_parser(command: str) -> argparse.ArgumentParser:
    top = build_parser(only=command)
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices[command]
    return parser


def visible_flags(command: str) -> list[tuple[str, str]]:
    """(long flag, help) of each flag `weir COMMAND --help` shows."""
    return [
        (next(o for o in a.option_strings if o.startswith("--")), " ".join((a.help or "").split()))
        for a in command_parser(command)._actions
        if a.option_strings and a.help != argparse.SUPPRESS
    ]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_names_its_variable(command: str) -> None:
    silent = [
        flag
        for flag, help_text in visible_flags(command)
        if flag not in NO_VARIABLE and not NAMED.search(help_text)
    ]
    assert not silent, f"weir {command}: no environment variable in the help of {', '.join(silent)}"


def test_a_variable_means_one_flag_in_every_command() -> None:
    """WEIR_NAMESPACE must not be the weir namespace in one command and Kubernetes' in another."""
    flags: dict[str, set[str]] = defaultdict(set)
    for command in COMMANDS:
        for flag, help_text in visible_flags(command):
            for name in NAMED.findall(help_text):
                flags[name].add(flag)
    assert len(flags) > 60
    shared = {name: sorted(found) for name, found in flags.items() if len(found) > 1}
    assert not shared, f"variables read by differently named flags: {shared}"


def test_a_variable_sets_the_default_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_KV_OVERLAP_WEIGHT", "2.5")
    monkeypatch.setenv("WEIR_ROUTER_MODE", "round-robin")
    args = build_parser(only="frontend").parse_args(["frontend"])
    assert (args.kv_overlap_weight, args.router_mode) == (2.5, "round-robin")
    args = build_parser(only="frontend").parse_args(["frontend", "--kv-overlap-weight", "0.5"])
    assert args.kv_overlap_weight == 0.5


def test_a_variable_keeps_its_hand_written_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_ROUTER_PORT", "9200")  # add_service_arguments' prefix, not WEIR_PORT
    monkeypatch.setenv("WEIR_PORT", "1")
    assert build_parser(only="router").parse_args(["router"]).port == 9200


@pytest.mark.parametrize(
    ("text", "value"), [("1", True), ("Yes", True), ("true", True), ("0", False), ("no", False)]
)
def test_a_switch_reads_a_boolean(text: str, value: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_NO_KV_EVENTS", text)
    assert build_parser(only="serve").parse_args(["serve"]).no_kv_events is value


def test_a_variable_stands_in_for_a_required_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_REPLICAS", "3")
    assert build_parser(only="scale").parse_args(["scale", "decode"]).replicas == 3


@pytest.mark.parametrize(
    ("name", "value", "command"),
    [
        ("WEIR_WORKERS", "many", "serve"),
        ("WEIR_ROUTER_MODE", "nope", "frontend"),
        ("WEIR_NO_KV_EVENTS", "maybe", "router"),
        ("WEIR_REPLICAS", "-1", "scale"),
    ],
)
def test_an_invalid_value_names_the_variable(
    name: str, value: str, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        build_parser(only=command)
    message = str(exit_info.value.code)
    assert message.startswith(f"weir: environment variable {name}={value!r} is invalid: ")
    assert "\n" not in message


def test_the_kubernetes_namespace_is_not_the_weir_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_NAMESPACE", "weir-ns")  # what every pod of the chart gets
    args = build_parser(only="status").parse_args(["status"])
    assert (args.namespace, args.weir_namespace) == (None, "weir-ns")
    monkeypatch.setenv("WEIR_KUBE_NAMESPACE", "llm")
    assert build_parser(only="status").parse_args(["status"]).namespace == "llm"


@pytest.mark.parametrize(
    ("command", "old", "new", "value"),
    [
        ("replay", "--router", "--router-mode", "random"),
        ("replay", "--overlap-weight", "--kv-overlap-weight", "2.0"),
        ("replay", "--temperature", "--router-temperature", "0.5"),
        ("replay", "--seed", "--router-seed", "7"),
        ("replay", "--cache-blocks", "--num-blocks", "128"),
        ("replay", "--model", "--served-model-name", "m"),
        ("replay", "--speedup", "--trace-speedup", "4"),
        ("replay", "--output", "--output-file", "out.json"),
        ("drain", "--timeout", "--drain-timeout", "5"),
        ("frontend", "--namespace", "--weir-namespace", "ns"),
    ],
)
def test_an_old_spelling_still_works_but_says_so(
    command: str, old: str, new: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    positional = {"replay": ["trace.jsonl"], "drain": ["worker-0"]}.get(command, [])
    parser = build_parser(only=command)
    assert parser.parse_args([command, *positional, old, value]) == parser.parse_args(
        [command, *positional, new, value]
    )
    assert f"{old} is now {new}" in capsys.readouterr().err
    assert old not in {flag for flag, _ in visible_flags(command)}


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"weir {importlib.metadata.version('weir')}\n"
