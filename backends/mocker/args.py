"""Command-line flags for mocker workers, shared by `weir serve` and `weir worker`."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from backends.mocker.config import OUTPUT_LENGTH_DISTRIBUTIONS, MockerConfig
from backends.mocker.timing import TimingModel

_DEFAULTS = MockerConfig()

# Config field -> help. Each becomes --field-name, typed like its default. The flags default
# to None so that one another backend already defined (say --block-size) keeps its meaning.
_FLAGS: dict[str, str] = {
    "speedup": "simulated time / wall time; a large value means near-zero delay",
    "num_blocks": "KV blocks per mocker worker",
    "block_size": "tokens per KV block",
    "max_num_batched_tokens": "token budget per step",
    "max_num_seqs": "running sequences per step",
    "vocab_size": "generated token ids lie in [0, N): match the tokenizer",
    "context_length": "context length in the model card",
    "output_length_mean": "mean output length, EOS included, of a request without ignore_eos",
    "output_length_sigma": "sigma of the lognormal output length",
    "host_cache_blocks": "simulated G2 host-memory KV tier, in blocks (kvbm; 0: none)",
    "disk_cache_blocks": "simulated G3 disk KV tier below it, in blocks (0: none)",
    "kv_bytes_per_token": "KV bytes per token, for the time a tier takes to load a block",
}
# Fields `backends.registry` takes from the model directory when the flag is not given.
_FROM_MODEL: dict[str, str] = {
    "vocab_size": "the vocabulary size of the model's tokenizer.json",
    "context_length": "max_position_embeddings in the model's config.json",
}


def add_mocker_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the mocker's flags; a flag the parser already has is left as it is."""
    group = parser.add_argument_group("mocker backend")
    for dest, help_text in _FLAGS.items():
        default = getattr(_DEFAULTS, dest)
        from_model = _FROM_MODEL.get(dest)
        shown = f"default: {from_model} if it has one, else {default}" if from_model else f"default {default}"
        with contextlib.suppress(argparse.ArgumentError):  # already defined by another backend
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
    values: dict[str, Any] = {
        dest: getattr(args, dest)
        for dest in (*_FLAGS, "output_length_distribution")
        if getattr(args, dest, None) is not None
    }
    timing_file = getattr(args, "timing_model", None)
    if timing_file:
        values["timing"] = TimingModel.from_json(timing_file)
    values.update(overrides)
    return MockerConfig(**values)
