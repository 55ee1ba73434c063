"""What the engine adapters share (backends/adapter.py), checked once for all three."""

from __future__ import annotations

import argparse

import pytest

from backends.adapter import block_size_mismatch, choice_regex, engine_fields
from orchestrator.runtime.errors import EngineError


def test_a_block_size_the_engine_overrode_refuses_to_start() -> None:
    assert block_size_mismatch("vLLM", 16, None) is None  # the engine's own choice
    assert block_size_mismatch("vLLM", 32, 32) is None
    why = block_size_mismatch("vLLM", 16, 32)
    assert why is not None and why.startswith("vLLM chose block size 16, not --block-size 32")


def test_engine_fields_take_dashes_and_refuse_weirs_own() -> None:
    parse = engine_fields("Args fields", {"block_size": "--block-size"})
    assert parse('{"max-model-len": 8, "seed": 1}') == {"max_model_len": 8, "seed": 1}
    with pytest.raises(argparse.ArgumentTypeError, match="block_size is set by --block-size"):
        parse('{"block-size": 16}')
    with pytest.raises(argparse.ArgumentTypeError, match="JSON object of Args fields"):
        parse("[1]")


def test_a_choice_becomes_an_escaped_alternation() -> None:
    assert choice_regex(["a.b", "c d", "(e)"]) == r"(a\.b|c d|\(e\))"
    with pytest.raises(EngineError):
        choice_regex([])
