"""Checkpoint tensors into model parameters, through each parameter's `weight_loader`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from backends.deepinfer.layers.linear import WeightLoader, default_weight_loader
from backends.deepinfer.models.base import CausalLM


def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Fill every parameter of `model` from the `*.safetensors` files in `model_dir`.

    The model's `weight_target` maps a checkpoint name to (parameter, shard id); an unknown
    name or a parameter left unfilled is an error naming it, never a silently random weight."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())
    filled: set[tuple[str, Any]] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target = model.weight_target(name)
                if target is None:
                    continue
                param_name, shard = target
                if param_name not in params:
                    raise KeyError(f"{file.name}: tensor {name!r} matches no parameter ({param_name!r})")
                param = params[param_name]
                loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
                with torch.no_grad():
                    if shard is None:
                        loader(param, f.get_tensor(name))
                    else:
                        loader(param, f.get_tensor(name), shard)
                filled.add((param_name, shard))
    expected = {
        (name, shard) for name, p in params.items() for shard in getattr(p, "shard_ids", None) or [None]
    }
    missing = sorted({name for name, _ in expected - filled})
    if missing:
        raise ValueError(
            f"checkpoint {model_dir} lacks weights for {missing[:5]}{'...' if len(missing) > 5 else ''}"
        )
