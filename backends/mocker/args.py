"""The mocker's command-line flags and its `BackendSpec`, shared by `weir serve` and `weir worker`."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

from backends.mocker.config import OUTPUT_LENGTH_DISTRIBUTIONS, MockerConfig
from backends.mocker.engine import MockerEngine
from backends.mocker.timing import TimingModel
from backends.registry import SHARED_FLAGS, BackendSpec
from orchestrator.runtime.engine import Engine

_DEFAULTS = MockerConfig()

# Config field -> help. Each becomes --field-name, typed like its default. The flags default
# to None so that a flag left out keeps MockerConfig's default, or the model directory's value
# for the fields in _FROM_MODEL.
_FLAGS: dict[str, str] = {
    "speedup": "simulated time / wall time; a large value means near-zero delay",
    "num_blocks": "KV blocks per mocker worker",
    "vocab_size": "generated token ids lie in [0, N): match the tokenizer",
    "context_length": "context length in the model card",
    "output_length_mean": "mean output length, EOS included, of a request without ignore_eos",
    "output_length_sigma": "sigma of the lognormal output length",
    "host_cache_blocks": "simulated G2 host-memory KV tier, in blocks (kvbm; 0: none)",
    "disk_cache_blocks": "simulated G3 disk KV tier below it, in blocks (0: none)",
    "kv_bytes_per_token": "KV bytes per token, for the time a tier takes to load a block",
}
# Fields `_build` takes from the model directory when the flag is not given.
_FROM_MODEL: dict[str, str] = {
    "vocab_size": "the vocabulary size of the model's tokenizer.json",
    "context_length": "max_position_embeddings in the model's config.json",
}


def add_mocker_arguments(parser: argparse.ArgumentParser) -> None:
    """The mocker's own flags, in their own group (`backends.registry` declares the shared ones)."""
    group = parser.add_argument_group("mocker backend")
    for dest, help_text in _FLAGS.items():
        default = getattr(_DEFAULTS, dest)
        from_model = _FROM_MODEL.get(dest)
        shown = f"default: {from_model} if it has one, else {default}" if from_model else f"default {default}"
        group.add_argument(
            "--" + dest.replace("_", "-"),
            dest=dest,
            type=type(default),
            default=None,
            help=f"{help_text} ({shown})",
        )
    group.add_argument(
        "--output-length-distribution",
        choices=OUTPUT_LENGTH_DISTRIBUTIONS,
        default=None,
        help="how output lengths spread around the mean: lognormal (by --output-length-sigma), geometric "
        f"(EOS equally likely at every token) or fixed (default {_DEFAULTS.output_length_distribution})",
    )
    group.add_argument(
        "--timing-model",
        metavar="FILE",
        default=None,
        help='JSON timing model {"prefill_ms": [c0, c1, c2], "decode_ms": [...], "min_decode_ms": 1}, '
        "ms = c0 + c1*x + c2*x^2 (default: Dynamo's mocker polynomial)",
    )


def mocker_config_from_args(args: argparse.Namespace, **overrides: Any) -> MockerConfig:
    """A MockerConfig from parsed flags; `overrides` (e.g. model_name, model_path) win.
    Raises ValueError for a bad value or an unreadable timing model file."""
    # kv_eviction is DeepInfer's flag (backends/deepinfer/args.py): the mocker runs its block pool.
    values: dict[str, Any] = {
        dest: getattr(args, dest)
        for dest in (*_FLAGS, *SHARED_FLAGS, "output_length_distribution", "kv_eviction")
        if getattr(args, dest, None) is not None
    }
    timing_file = getattr(args, "timing_model", None)
    if timing_file:
        values["timing"] = TimingModel.from_json(timing_file)
    values.update(overrides)
    return MockerConfig(**values)


def _build(args: argparse.Namespace, model_dir: Path, served_name: str) -> Engine:
    """A mocker shaped like the model in `model_dir` where the flags leave it open."""
    shape = {key: value for key, value in _model_shape(model_dir).items() if getattr(args, key, None) is None}
    return MockerEngine(
        mocker_config_from_args(
            args, model_name=served_name, model_path=str(model_dir), worker_id=args.worker_id, **shape
        )
    )


def _model_shape(model_dir: Path) -> dict[str, Any]:
    """What the mocker must agree on with the model: the tokenizer's vocabulary (so generated
    ids decode), its EOS ids (so a mocked answer ends as the model's would) and the context
    length, where the directory says."""
    from tokenizers import Tokenizer  # for building a worker, not for parsing its flags

    from orchestrator.runtime.model_files import eos_token_ids

    shape: dict[str, Any] = {}
    if (model_dir / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        shape["vocab_size"] = tokenizer.get_vocab_size(with_added_tokens=True)
        if eos := eos_token_ids(model_dir, tokenizer):
            shape["eos_token_ids"] = eos
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((model_dir / "config.json").read_text())
        if isinstance(config.get("max_position_embeddings"), int):
            shape["context_length"] = config["max_position_embeddings"]
    return shape


SPEC = BackendSpec(
    description="a simulated engine (no model, no GPU)",
    add_arguments=add_mocker_arguments,
    defaults={
        "block_size": _DEFAULTS.block_size,
        "max_num_seqs": _DEFAULTS.max_num_seqs,
        "max_num_batched_tokens": _DEFAULTS.max_num_batched_tokens,
    },
    build=_build,
)
