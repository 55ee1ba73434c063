"""The backend registry: every backend's flags parse side by side, the shared flags take each
backend's own default, an unknown backend is refused, and a mocker worker never imports torch."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from backends.deepinfer.config import EngineConfig
from backends.mocker.config import MockerConfig
from backends.mocker.engine import MockerEngine
from backends.registry import (
    BACKENDS,
    SHARED_FLAGS,
    BackendSpec,
    add_backend_arguments,
    backend_spec,
    make_engine,
)
from orchestrator.runtime.engine import Engine
from tests.cli.procs import REPO
from tests.frontend.tokenizer_dirs import build_chatml

# Each bundled backend's config class, whose defaults the shared flags must fall back to.
CONFIGS: dict[str, type[MockerConfig | EngineConfig]] = {"mocker": MockerConfig, "deepinfer": EngineConfig}
# Adapters whose shared defaults are the engine's own choice (None): Weir passes only what is given.
ADAPTERS = ("vllm", "sglang", "trtllm")


def backend_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_backend_arguments(parser)
    return parser


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Enough of a model for either backend to build (DeepInfer loads weights only on start)."""
    path = build_chatml(tmp_path)
    (path / "config.json").write_text("{}")
    return path


def built_config(engine: Engine) -> MockerConfig | EngineConfig:
    from backends.deepinfer.worker import DeepInferWorker  # torch: only the tests that build one

    assert isinstance(engine, MockerEngine | DeepInferWorker)
    return engine.config


def test_every_backend_is_registered_with_its_config() -> None:
    assert set(CONFIGS) | set(ADAPTERS) == set(BACKENDS)
    for name in ADAPTERS:
        assert all(value is None for value in backend_spec(name).defaults.values())


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backends_flags_parse_beside_the_others(name: str) -> None:
    alone = argparse.ArgumentParser()
    backend_spec(name).add_arguments(alone)
    own = {flag for action in alone._actions for flag in action.option_strings} - {"-h", "--help"}
    shared = {"--" + dest.replace("_", "-") for dest in SHARED_FLAGS}
    assert own and not own & shared, "a backend declares only its own flags"
    args = vars(backend_parser().parse_args(["--backend", name]))
    assert args.items() >= vars(alone.parse_args([])).items()  # the same flags, the same defaults
    assert all(args[dest] is None for dest in SHARED_FLAGS)  # left for the backend to fill


@pytest.mark.parametrize("name", CONFIGS)
def test_shared_flags_take_each_backends_own_default(name: str, model_dir: Path) -> None:
    argv = ["--backend", name, "--model", str(model_dir)]
    config = built_config(make_engine(backend_parser().parse_args(argv), model_dir, "aggregated", "w"))
    defaults = CONFIGS[name]()
    assert {dest: getattr(config, dest) for dest in SHARED_FLAGS} == {
        dest: getattr(defaults, dest) for dest in SHARED_FLAGS
    }
    given = backend_parser().parse_args([*argv, "--block-size", "32", "--max-num-seqs", "4"])
    config = built_config(make_engine(given, model_dir, "aggregated", "w"))
    assert (config.block_size, config.max_num_seqs) == (32, 4)
    assert config.max_num_batched_tokens == defaults.max_num_batched_tokens


@pytest.mark.parametrize("name", CONFIGS)
def test_kv_eviction_reaches_deepinfers_block_pool_and_the_mockers(name: str, model_dir: Path) -> None:
    """DeepInfer declares --kv-eviction; the mocker runs the same block pool and takes it too."""
    argv = ["--backend", name, "--model", str(model_dir)]
    default = built_config(make_engine(backend_parser().parse_args(argv), model_dir, "aggregated", "w"))
    assert default.kv_eviction == "lru"
    engine = make_engine(
        backend_parser().parse_args([*argv, "--kv-eviction", "slru"]), model_dir, "aggregated", "w"
    )
    assert built_config(engine).kv_eviction == "slru"
    with pytest.raises(SystemExit):
        backend_parser().parse_args([*argv, "--kv-eviction", "lfu"])
    with pytest.raises(ValueError, match="kv_eviction must be one of lru, slru, arc, got 'lfu'"):
        CONFIGS[name](kv_eviction="lfu")  # type: ignore[arg-type]


def test_an_unknown_backend_is_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=f"unknown backend 'llamacpp'; choose one of {', '.join(BACKENDS)}"):
        backend_spec("llamacpp")
    args = backend_parser().parse_args([])
    args.backend = "llamacpp"
    with pytest.raises(ValueError, match="unknown backend 'llamacpp'"):
        make_engine(args, model_dir, "aggregated", "w")
    with pytest.raises(SystemExit):  # argparse names the choices
        backend_parser().parse_args(["--backend", "llamacpp"])


def test_a_role_the_backend_cannot_serve_is_refused(model_dir: Path) -> None:
    args = backend_parser().parse_args(["--backend", "vllm", "--model", str(model_dir)])
    with pytest.raises(ValueError, match="the vllm backend serves role aggregated, not prefill"):
        make_engine(args, model_dir, "prefill", "w")


def test_vllm_engine_args_pass_through_but_not_weirs_own(model_dir: Path) -> None:
    from backends.vllm.args import vllm_engine_args

    argv = ["--backend", "vllm", "--model", str(model_dir)]
    args = backend_parser().parse_args(
        [*argv, "--vllm-engine-args", '{"max-model-len": 2048, "enforce_eager": true}']
    )
    fields = vllm_engine_args(args, model_dir, "m")
    assert fields["max_model_len"] == 2048 and fields["enforce_eager"] is True
    assert fields["model"] == str(model_dir) and fields["served_model_name"] == "m"
    assert "block_size" not in fields and "max_num_seqs" not in fields  # vLLM's own choice
    given = backend_parser().parse_args([*argv, "--block-size", "64", "--max-num-seqs", "8"])
    assert {k: vllm_engine_args(given, model_dir, "m")[k] for k in ("block_size", "max_num_seqs")} == {
        "block_size": 64,
        "max_num_seqs": 8,
    }
    for owned in ('{"block_size": 16}', '{"kv_events_config": {}}', "[1]", "{nope"):
        with pytest.raises(SystemExit):
            backend_parser().parse_args([*argv, "--vllm-engine-args", owned])


def test_a_spec_must_give_every_shared_default() -> None:
    spec = backend_spec("mocker")
    with pytest.raises(ValueError, match="must cover"):
        BackendSpec(spec.description, spec.add_arguments, {"block_size": 16}, spec.build)


def test_a_mocker_worker_never_imports_torch(model_dir: Path) -> None:
    """Every backend's flags are parsed for any backend: their modules must not import their
    engines, and the mocker's engine must not need torch."""
    script = f"""
import contextlib, sys
from pathlib import Path
from backends.registry import make_engine
from orchestrator.cli.main import build_parser, main
with contextlib.suppress(SystemExit):
    main(["worker", "--backend", "mocker", "--help"])
argv = ["worker", "--backend", "mocker", "--model", {str(model_dir)!r}]
make_engine(build_parser(only="worker").parse_args(argv), Path(argv[-1]), "aggregated", "w")
print(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "vllm")))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"
