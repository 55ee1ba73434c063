"""Every `weir ...` command line in README.md and docs/*.md parses with the real argument
parser (parse only, nothing runs), so renaming or removing a flag fails here until the docs
follow. Old spellings (hidden aliases) count as failures too: the docs show the current name.

Command lines come from fenced shell blocks (continuations, `$ ` prompts, `&&`, trailing `&`,
comments, VAR=value prefixes) and from inline code spans. Placeholders: `<anything>`, an
upper-case word as the value of a typed flag (`--replicas N`: a valid value stands in),
`[optional parts]`, `...`, `a|b` or `a/b` or COMMAND in the command's place, and a last flag
without its value (prose mentioning `weir worker --backend`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

from orchestrator.cli.main import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*```\s*(\S*)")
INLINE = re.compile(r"`([^`]+)`")
ENV_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=")
PLACEHOLDER_VALUE = re.compile(r"^[A-Z][A-Z_]*$")
NAMED = re.compile(r"\benv (WEIR_[A-Z0-9_]+)")


def doc_commands(markdown: str) -> list[tuple[int, str]]:
    """(line number, text) of each `weir` command line in fenced shell blocks and inline code."""
    found: list[tuple[int, str]] = []
    prose = markdown.splitlines()
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            i += 1
        body = list(enumerate(lines[start + 1 : i], start + 2))
        for n in range(start, min(i + 1, len(lines))):
            prose[n] = ""  # so inline spans are not looked for inside blocks
        i += 1
        if fence.group(1) in SHELL_BLOCKS:
            found += _block_commands(body)
    text = "\n".join(prose)
    for span in INLINE.finditer(text):
        code = " ".join(span.group(1).split())
        if code.startswith("weir "):
            found.append((text.count("\n", 0, span.start()) + 1, code))
    return sorted(found)


def _block_commands(body: list[tuple[int, str]]) -> list[tuple[int, str]]:
    prompted = any(line.lstrip().startswith("$ ") for _, line in body)
    logical: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in body:
        if pending is None:
            if prompted and not line.lstrip().startswith("$ "):
                continue  # the output of a command shown with a prompt
            pending = (number, line.lstrip().removeprefix("$ "))
        else:
            pending = (pending[0], pending[1] + " " + line.strip())
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1])
        else:
            logical.append(pending)
            pending = None
    commands = []
    for number, line in logical:
        for part in re.split(r"&&|\|\||;|\s\|\s", line.split(" #")[0]):
            part = part.strip().removesuffix("&").strip()
            words = part.split()
            while words and ENV_PREFIX.match(words[0]):
                words.pop(0)
            if words and words[0] == "weir":
                commands.append((number, " ".join(part.split())))
    return commands


def parse_error(command_line: str) -> str | None:
    """Why `command_line` does not parse, or None when it does (without deprecation notes)."""
    words = [
        word.strip("[]")
        for word in shlex.split(re.sub(r"<[^<>]+>", "PLACEHOLDER", command_line))
        if word.strip("[]") not in ("...", "…", "")
    ]
    env: dict[str, str] = {}
    while words and ENV_PREFIX.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "weir", command_line
    if len(words) == 1:
        return None
    if words[1].startswith("-"):  # weir's own options
        return _parse(None, words[1:], env)
    named = re.split(r"[|/]", words[1])
    commands = sorted(COMMANDS) if named == ["COMMAND"] else named
    for command in commands:
        if command not in COMMANDS:
            return f"no command {command!r}"
        rest = words[2:]
        if not rest and not env:
            continue  # a mention of the command itself
        error = _parse(command, rest, env)
        if error:
            return error
    return None


def _parse(command: str | None, rest: list[str], env: dict[str, str]) -> str | None:
    """Parse `weir COMMAND REST`, or `weir REST` without a command, with the line's `env`
    and none of this shell's WEIR_ variables (CI's WEIR_HELM, say)."""
    ambient = {name: value for name, value in os.environ.items() if not name.startswith("WEIR_")}
    with mock.patch.dict(os.environ, ambient | env, clear=True):
        return _parse_in_environment(command, rest, env)


def _parse_in_environment(command: str | None, rest: list[str], env: dict[str, str]) -> str | None:
    top = build_parser(only=command or "")
    sub = top
    if command is not None:
        sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    variables = set(NAMED.findall(" ".join((a.help or "") for a in sub._actions)))
    unknown = sorted(name for name in env if name not in variables)
    if unknown:
        return f"{', '.join(unknown)} is not one of its environment variables"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            top.parse_args([*([command] if command else []), *_fill_placeholders(sub, rest)])
        except SystemExit as exc:
            if exc.code != 0:  # 0: --help
                return stderr.getvalue().strip().splitlines()[-1]
    return stderr.getvalue().strip() or None


def _fill_placeholders(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """An upper-case placeholder given to a flag with a type or choices becomes a valid value,
    and so does the missing value of a last flag."""
    last = parser._option_string_actions.get(words[-1]) if words else None
    if last is not None and last.nargs is None:
        words = [*words, "VALUE"]
    filled = list(words)
    for i, word in enumerate(words):
        flag, equals, value = word.partition("=")
        action = parser._option_string_actions.get(flag)
        if action is None or action.nargs is not None:
            continue
        at = i if equals else i + 1
        value = value if equals else (words[i + 1] if i + 1 < len(words) else "")
        if PLACEHOLDER_VALUE.match(value) and (action.type is not None or action.choices is not None):
            sample = str(next(iter(action.choices))) if action.choices is not None else "1"
            filled[at] = f"{flag}={sample}" if equals else sample
    return filled


def all_doc_commands() -> list[tuple[str, str]]:
    return [
        (f"{path.relative_to(REPO)}:{number}", text)
        for path in DOCS
        for number, text in doc_commands(path.read_text())
    ]


def test_the_docs_hold_command_lines() -> None:
    where = {place.split(":")[0] for place, _ in all_doc_commands()}
    assert len(all_doc_commands()) >= 30
    assert {"README.md", "docs/kubernetes.md", "docs/router.md"} <= where


@pytest.mark.parametrize(("place", "command_line"), all_doc_commands())
def test_doc_command_line_parses(place: str, command_line: str) -> None:
    error = parse_error(command_line)
    assert error is None, f"{place}: `{command_line}` does not parse: {error}"


def test_extraction_handles_shell_and_inline_forms() -> None:
    markdown = "\n".join(
        [
            "Run `weir serve",  # 1: an inline span across lines
            "--workers 2` first; `pip install weir` is not a command line.",
            "```bash",
            "# a comment",
            "pip install -e . && WEIR_PORT=1 weir serve  # trailing comment",  # 5
            "weir worker --backend mocker \\",  # 6
            "  --etcd http://127.0.0.1:2379 &",
            "```",
            "```console",
            "$ weir status -o json",  # 10
            "weir     decode   decode   6",
            "```",
            "```python",
            'weir = "not shell"',
            "```",
        ]
    )
    assert doc_commands(markdown) == [
        (1, "weir serve --workers 2"),
        (5, "WEIR_PORT=1 weir serve"),
        (6, "weir worker --backend mocker --etcd http://127.0.0.1:2379"),
        (10, "weir status -o json"),
    ]


@pytest.mark.parametrize(
    "command_line",
    [
        "weir serve --workers 2",
        "WEIR_WORKERS=2 weir serve",
        "weir drain <instance id or pod> [--drain-timeout S]",
        "weir scale POOL --replicas N [--dry-run]",
        "weir worker --backend=B --role=R --port=9000",
        "weir frontend|serve --api-key KEY",
        "weir scale/status/drain",
        "weir COMMAND --help",
        "weir router --port 9100 [--router-mode kv ...]",
        "weir --version",
        "weir worker --backend",
        "weir serve --port",
    ],
)
def test_placeholders_parse(command_line: str) -> None:
    assert parse_error(command_line) is None


@pytest.mark.parametrize(
    ("command_line", "error"),
    [
        ("weir serve --wrokers 2", "unrecognized arguments: --wrokers 2"),
        ("weir replay t.jsonl --router kv", "--router is now --router-mode"),
        ("weir serve --workers two", "invalid int value: 'two'"),
        ("weir scale --replicas 2", "the following arguments are required: pool"),
        ("weir serve|nope", "no command 'nope'"),
        ("weir --verbose", "unrecognized arguments: --verbose"),
        ("WEIR_NOPE=1 weir serve", "WEIR_NOPE is not one of its environment variables"),
    ],
)
def test_a_wrong_command_line_is_reported(command_line: str, error: str) -> None:
    assert error in (parse_error(command_line) or "")
