"""A checkpoint's config.json, read once, with attribute access and defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class HFConfig:
    """The raw config.json fields. Missing fields raise AttributeError naming the file, so a
    checkpoint lacking something a model needs fails with a clear message; `get` has defaults."""

    def __init__(self, fields: dict[str, Any], source: str = "config.json") -> None:
        self._fields = fields
        self._source = source

    @classmethod
    def load(cls, model_dir: Path) -> HFConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a checkpoint directory: no config.json")
        return cls(json.loads(path.read_text()), str(path))

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__.get("_fields", {})
        if name in fields and fields[name] is not None:
            return fields[name]
        raise AttributeError(f"{self.__dict__.get('_source')} has no {name!r}")

    def get(self, name: str, default: Any = None) -> Any:
        value = self._fields.get(name)
        return default if value is None else value

    @property
    def architecture(self) -> str:
        archs = self.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"{self._source}: expected one entry in 'architectures', got {archs}")
        return str(archs[0])

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding attention window (None: full attention), as transformers
        assigns them: `layer_types` when the config lists them; Qwen's `use_sliding_window`
        from layer `max_window_layers` on; else `sliding_window` for every layer (Mistral)."""
        window = self.get("sliding_window")
        layers = range(self.num_hidden_layers)
        if not window:
            return [None for _ in layers]
        if self.get("layer_types"):
            return [int(window) if kind == "sliding_attention" else None for kind in self.layer_types]
        if "use_sliding_window" in self._fields:
            first = int(self.get("max_window_layers", 28)) if self.get("use_sliding_window") else len(layers)
            return [int(window) if i >= first else None for i in layers]
        return [int(window) for _ in layers]

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer: `num_experts` as Qwen's checkpoints name it, or
        `num_local_experts` as transformers 5 writes it."""
        return int(self.get("num_experts") or self.get("num_local_experts") or 0)

    @property
    def head_dim(self) -> int:
        return int(self.get("head_dim") or self.hidden_size // self.num_attention_heads)

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """RoPE settings in transformers 5's shape (`rope_parameters`), also accepting the older
        `rope_theta` + `rope_scaling` fields."""
        params = dict(self.get("rope_parameters") or self.get("rope_scaling") or {})
        params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
        params.setdefault("rope_theta", self.get("rope_theta", 10000.0))
        kind = params["rope_type"]
        if kind in ("llama3", "yarn"):
            params.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        elif kind == "dynamic":  # transformers scales from max_position_embeddings, whatever else is set
            params["original_max_position_embeddings"] = self.max_position_embeddings
        elif kind == "longrope":
            trained = self.get("original_max_position_embeddings", self.max_position_embeddings)
            params.setdefault("original_max_position_embeddings", trained)
            params.setdefault(
                "factor", self.max_position_embeddings / params["original_max_position_embeddings"]
            )
        return params
