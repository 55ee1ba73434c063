"""The DeepInfer checkpoints the benchmarks run: SmolLM2-135M-Instruct (the bundled default,
converted once into the weir cache) or a tiny random Llama built in `scratch`."""

from __future__ import annotations

from pathlib import Path

MODELS = ("smollm2", "tiny")


def deepinfer_model(name: str, scratch: Path, **tiny_overrides: int) -> Path:
    """The checkpoint directory of `name`; `tiny_overrides` replace the tiny Llama's config
    fields (e.g. `hidden_size=256, num_hidden_layers=4`)."""
    if name == "tiny":
        from backends.deepinfer.tiny import build_checkpoint

        return build_checkpoint(scratch / "tiny-llama", "llama", **tiny_overrides)
    from backends.deepinfer.smollm2 import ensure_default_model

    return ensure_default_model()
