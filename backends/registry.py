"""Which engines a worker can run, and how a command line becomes one.

`weir worker` and `weir serve` call `add_backend_arguments` for every backend's flags and
`make_engine` to build the chosen one; each backend keeps its own flags and config next to its
code (`backends.mocker.args`, `backends.deepinfer.worker`). Flags that several backends share
(--block-size, --max-num-seqs, ...) are declared once, here, without a default, so each
backend applies its own: the mocker's are NVIDIA Dynamo's, DeepInfer's are its EngineConfig's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any, cast

from orchestrator.runtime.engine import Engine

BACKENDS = ("mocker", "deepinfer")
# What `weir serve` and `weir worker` run without --backend.
DEFAULT_BACKEND = "deepinfer"
DEFAULT_MODEL = "smollm2-135m-instruct"

# Flags with the same meaning in several backends: (flag, help).
_SHARED_FLAGS = [
    ("--block-size", "tokens per KV block (default: the backend's; mocker 64)"),
    ("--max-num-seqs", "most sequences running at once (default: the backend's; mocker 256)"),
    ("--max-num-batched-tokens", "token budget per engine step (default: the backend's; mocker 8192)"),
]


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """--backend, --model, --served-model-name, the shared flags, then each backend's own."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        default=DEFAULT_BACKEND,
        help=f"token engine (default {DEFAULT_BACKEND})",
    )
    group.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="DIR_OR_NAME",
        help="a Hugging Face model directory (config.json, tokenizer.json, tokenizer_config.json); "
        f"the mocker needs only the tokenizer files. {DEFAULT_MODEL!r} is the bundled default, "
        f"converted once into ~/.cache/weir (default {DEFAULT_MODEL})",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients ask for (default: the directory's name)",
    )
    for flag, help_text in _SHARED_FLAGS:
        group.add_argument(flag, type=int, default=None, help=help_text)
    from backends.deepinfer.args import add_deepinfer_arguments
    from backends.mocker.args import add_mocker_arguments

    add_mocker_arguments(parser)
    add_deepinfer_arguments(cast(argparse.ArgumentParser, _SkipDeclared(parser)))


def resolve_model(value: str) -> Path:
    """The model directory for --model: a path as given, or the bundled default by name."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path.resolve()
    if value == DEFAULT_MODEL:
        from backends.deepinfer.smollm2 import ensure_default_model

        return ensure_default_model()
    raise ValueError(f"--model {value!r} is neither a directory nor {DEFAULT_MODEL!r}")


def served_name(args: argparse.Namespace, model_dir: Path) -> str:
    if args.served_model_name:
        return str(args.served_model_name)
    return DEFAULT_MODEL if args.model == DEFAULT_MODEL else model_dir.name


def make_engine(args: argparse.Namespace, model_dir: Path) -> Engine:
    """The engine `args` ask for, serving `model_dir` (from `resolve_model`) under
    `served_name(args, model_dir)`. Raises ValueError for flags the backend rejects."""
    name = served_name(args, model_dir)
    engine: Engine
    if args.backend == "mocker":
        from backends.mocker.args import mocker_config_from_args
        from backends.mocker.engine import MockerEngine

        shape = _model_shape(model_dir)
        overrides = {key: value for key, value in shape.items() if getattr(args, key, None) is None}
        engine = MockerEngine(
            mocker_config_from_args(args, model_name=name, model_path=str(model_dir), **overrides)
        )
    elif args.backend == "deepinfer":
        from backends.deepinfer.args import deepinfer_config_from_args
        from backends.deepinfer.config import EngineConfig
        from backends.deepinfer.worker import DeepInferWorker

        defaults = EngineConfig()
        values = vars(args) | {"model": str(model_dir), "served_model_name": name}
        for flag, _ in _SHARED_FLAGS:
            dest = flag[2:].replace("-", "_")
            if values[dest] is None:
                values[dest] = getattr(defaults, dest)
        engine = DeepInferWorker(deepinfer_config_from_args(argparse.Namespace(**values)))
    else:
        raise ValueError(f"unknown backend {args.backend!r}; choose one of {', '.join(BACKENDS)}")
    return engine


def _model_shape(model_dir: Path) -> dict[str, Any]:
    """What the mocker must agree on with the model: the tokenizer's vocabulary (so generated
    ids decode), its EOS ids (so a mocked answer ends as the model's would) and the context
    length, where the directory says."""
    from tokenizers import Tokenizer

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


class _SkipDeclared:
    """Hands a backend's flag function a parser on which re-declaring a flag that is already
    there (one of `_SHARED_FLAGS`, --model, ...) is a no-op rather than an argparse conflict."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def add_argument_group(self, *args: Any, **kwargs: Any) -> _SkipDeclared:
        return _SkipDeclared(self._target.add_argument_group(*args, **kwargs))

    def add_argument(self, *args: Any, **kwargs: Any) -> None:
        with contextlib.suppress(argparse.ArgumentError):
            self._target.add_argument(*args, **kwargs)
