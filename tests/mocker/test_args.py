"""Mocker flags -> MockerConfig, as the CLI builds mocker workers."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from backends.mocker.args import mocker_config_from_args
from backends.mocker.config import MockerConfig
from backends.mocker.engine import MockerEngine
from backends.registry import add_backend_arguments, make_engine
from orchestrator.runtime.model_files import eos_token_ids
from tests.frontend.tokenizer_dirs import build_chatml


def parse(argv: list[str]) -> argparse.Namespace:
    """`argv` as `weir worker` parses it: the mocker's flags and those every backend shares."""
    parser = argparse.ArgumentParser()
    add_backend_arguments(parser)
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
        f"--max-num-seqs 8 --vocab-size 1000 --context-length 2048 --timing-model {timing} "
        "--output-length-mean 40 --output-length-distribution geometric --output-length-sigma 0.5".split()
    )
    config = mocker_config_from_args(args)
    assert (config.output_length_mean, config.output_length_distribution, config.output_length_sigma) == (
        40.0,
        "geometric",
        0.5,
    )
    assert (config.speedup, config.num_blocks, config.block_size) == (100.0, 64, 16)
    tiers = mocker_config_from_args(
        parse(["--host-cache-blocks", "128", "--disk-cache-blocks", "256", "--kv-bytes-per-token", "1024"])
    )
    assert (tiers.host_cache_blocks, tiers.disk_cache_blocks, tiers.kv_bytes_per_token) == (128, 256, 1024)
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.vocab_size) == (512, 8, 1000)
    assert config.context_length == 2048
    assert config.timing.prefill(10) == pytest.approx(6.0) and config.timing.decode(0.3) == 2.0


def test_bad_values_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="speedup"):
        mocker_config_from_args(parse(["--speedup", "0"]))
    with pytest.raises(ValueError, match="output_length_mean"):
        mocker_config_from_args(parse(["--output-length-mean", "0.5"]))
    with pytest.raises(SystemExit):  # argparse names the choices
        parse(["--output-length-distribution", "uniform"])
    with pytest.raises(ValueError, match="eos_token_ids"):
        MockerConfig(vocab_size=10, eos_token_ids=[10])
    with pytest.raises(ValueError, match="cannot read timing model"):
        mocker_config_from_args(parse(["--timing-model", str(tmp_path / "missing.json")]))


def test_a_mocker_worker_takes_eos_and_vocabulary_from_the_tokenizer(tmp_path: Path) -> None:
    model_dir = build_chatml(tmp_path)
    engine = make_engine(parse(["--backend", "mocker"]), model_dir, "aggregated", "w")
    assert isinstance(engine, MockerEngine)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # The ids the frontend stops on, the tokenizer's eos first: the one the mocker emits.
    assert engine.card.eos_token_ids == eos_token_ids(model_dir, tokenizer)
    assert engine.card.eos_token_ids[0] == tokenizer.token_to_id("<|im_end|>")
    assert engine.config.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)
    tiered = make_engine(
        parse(["--backend", "mocker", "--host-cache-blocks", "8"]), model_dir, "aggregated", "w"
    )
    assert isinstance(tiered, MockerEngine) and tiered.core.tiers is not None
    # Its weir_kvbm_* series carry the worker's instance id, as its weir_worker_* ones do.
    assert tiered.core.tiers.worker == "w"
