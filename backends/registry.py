"""Which engines a worker can run, and how a command line becomes one.

Each backend describes itself in one `BackendSpec`, named `SPEC` in a module of its own package
(`backends.mocker.args`, `backends.deepinfer.args`): its flags, its defaults for the flags every
backend shares, and how it builds its `Engine`. Adding a backend is that module plus one line
in `_SPEC_MODULES`. `weir worker` and `weir serve` call `add_backend_arguments` for every
backend's flags and `make_engine` to build the chosen one.

A spec module must not import its engine: --help lists every backend's flags, so each spec is
loaded to parse any command line, and `weir worker --backend mocker` must not pay for torch.
A spec's `build` imports the engine once that backend is the one asked for.

The shared flags (`SHARED_FLAGS`) are declared once, here, with no default, so that each
backend applies its own (`BackendSpec.defaults`): the mocker's are NVIDIA Dynamo's, DeepInfer's
are its EngineConfig's, and an adapter's may be None, "the engine's own choice" (vLLM picks its
block size by platform), which its card then reports.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from orchestrator.runtime.engine import Engine
from orchestrator.runtime.protocol import Role

# What `weir serve` and `weir worker` run without --backend.
DEFAULT_BACKEND = "deepinfer"
DEFAULT_MODEL = "smollm2-135m-instruct"

# Integer flags with one meaning in every backend: dest -> help.
SHARED_FLAGS: dict[str, str] = {
    "block_size": "tokens per KV block",
    "max_num_seqs": "most sequences running at once",
    "max_num_batched_tokens": "token budget per engine step",
}


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One backend, as the command line sees it."""

    description: str  # a few words for --backend's help
    # Adds the backend's own flags, in groups of its own; never a shared one, nor --model.
    add_arguments: Callable[[argparse.ArgumentParser], None]
    # The backend's value of each of SHARED_FLAGS; None: the engine chooses.
    defaults: Mapping[str, int | None]
    # (args, model directory, served model name) -> the engine. Every shared flag in `args`
    # is set: the user's value, else the one in `defaults`.
    build: Callable[[argparse.Namespace, Path, str], Engine]
    # The roles its engine can serve; disaggregation needs the KV data plane (`read_transfer`).
    roles: tuple[Role, ...] = ("aggregated", "prefill", "decode")

    def __post_init__(self) -> None:
        if set(self.defaults) != set(SHARED_FLAGS):
            raise ValueError(
                f"backend defaults must cover {sorted(SHARED_FLAGS)}, not {sorted(self.defaults)}"
            )


# Backend name -> the module whose SPEC describes it. Named, not imported: those modules import
# BackendSpec from here, and `from backends.registry import DEFAULT_MODEL` stays cheap.
_SPEC_MODULES: dict[str, str] = {
    "mocker": "backends.mocker.args",
    "deepinfer": "backends.deepinfer.args",
    "vllm": "backends.vllm.args",
    "sglang": "backends.sglang.args",
    "trtllm": "backends.trtllm.args",
}
BACKENDS = tuple(_SPEC_MODULES)


def backend_spec(name: str) -> BackendSpec:
    """The spec of backend `name`; ValueError for a backend there is not."""
    if name not in _SPEC_MODULES:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    spec: BackendSpec = importlib.import_module(_SPEC_MODULES[name]).SPEC
    return spec


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """--backend, --model, --served-model-name, the shared flags, then each backend's own."""
    specs = {name: backend_spec(name) for name in BACKENDS}
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        default=DEFAULT_BACKEND,
        help=f"token engine: {'; '.join(f'{name}, {spec.description}' for name, spec in specs.items())} "
        f"(default {DEFAULT_BACKEND})",
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
    for dest, help_text in SHARED_FLAGS.items():
        defaults = ", ".join(
            f"{name} {'its own' if spec.defaults[dest] is None else spec.defaults[dest]}"
            for name, spec in specs.items()
        )
        group.add_argument(
            "--" + dest.replace("_", "-"),
            type=int,
            default=None,
            help=f"{help_text} (default: the backend's; {defaults})",
        )
    for spec in specs.values():
        spec.add_arguments(parser)


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


def make_engine(args: argparse.Namespace, model_dir: Path, role: Role, worker_id: str) -> Engine:
    """The engine `args` ask for, serving `model_dir` (from `resolve_model`) under
    `served_name(args, model_dir)` in `role`, for the worker `worker_id` (its instance id, which
    the engine's own metrics carry too). Raises ValueError for an unknown backend, a role it
    cannot serve or flags it rejects."""
    spec = backend_spec(args.backend)
    if role not in spec.roles:
        raise ValueError(f"the {args.backend} backend serves role {' or '.join(spec.roles)}, not {role}")
    unset = {dest: default for dest, default in spec.defaults.items() if getattr(args, dest) is None}
    built = argparse.Namespace(**(vars(args) | unset | {"worker_id": worker_id}))
    return spec.build(built, model_dir, served_name(args, model_dir))
