"""Mocker flags -> MockerConfig, as the CLI builds mocker workers."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from backends.mocker.args import add_mocker_arguments, mocker_config_from_args
from backends.mocker.config import MockerConfig


def parse(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    parser = parser or argparse.ArgumentParser()
    add_mocker_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_dynamos() -> None:
    config = mocker_config_from_args(parse([]), model_name="m", model_path="/tok")
    assert config == MockerConfig(model_name="m", model_path="/tok")
    assert (config.num_blocks, config.block_size, config.max_num_batched_tokens, config.max_num_seqs) == (
        16_384,
        64,
        8_192,
        256,
    )


def test_flags_reach_the_config(tmp_path: Path) -> None:
    timing = tmp_path / "t.json"
    timing.write_text('{"prefill_ms": [1, 0.5], "decode_ms": [2]}')
    args = parse(
        "--speedup 100 --num-blocks 64 --block-size 16 --max-num-batched-tokens 512 "
        f"--max-num-seqs 8 --vocab-size 1000 --context-length 2048 --timing-model {timing}".split()
    )
    config = mocker_config_from_args(args)
    assert (config.speedup, config.num_blocks, config.block_size) == (100.0, 64, 16)
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.vocab_size) == (512, 8, 1000)
    assert config.context_length == 2048
    assert config.timing.prefill(10) == pytest.approx(6.0) and config.timing.decode(0.3) == 2.0


def test_a_flag_another_backend_defined_is_shared() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=None)
    args = parse(["--block-size", "32"], parser)
    assert mocker_config_from_args(args).block_size == 32


def test_bad_values_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="speedup"):
        mocker_config_from_args(parse(["--speedup", "0"]))
    with pytest.raises(ValueError, match="cannot read timing model"):
        mocker_config_from_args(parse(["--timing-model", str(tmp_path / "missing.json")]))
