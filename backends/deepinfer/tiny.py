"""Tiny local checkpoints: a byte-level BPE tokenizer trained here and random-weight models.

Nothing is downloaded. Tests build Llama, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3 checkpoints
(DeepSeek-V3's with its MTP layer given `num_nextn_predict_layers=1`) in the Hugging Face
layout (config.json, model.safetensors, tokenizer files), so the same directory feeds
DeepInfer and, as the reference, transformers. Everything is deterministic given the seed.

    from backends.deepinfer.tiny import build_checkpoint
    model_dir = build_checkpoint(tmp_path / "llama", "llama")

Weights are scaled so logits have a clear spread (std ~ a few units): with the usual 0.02 init
a tiny model's logits are nearly flat, and greedy comparisons would hinge on rounding.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer, models, pre_tokenizers

Arch = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_VOCAB_SIZE = 512  # tokenizer target; the model's vocab_size is this (the trainer may stop short)

# Training text for the tokenizer: enough English and code shapes for a few hundred merges.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of France is Paris.
An inference server turns prompts into tokens, runs a model over them, and streams the answer back.
A paged key-value cache stores attention state in fixed-size blocks; a block table maps positions to blocks.
The scheduler batches prefill chunks and decode steps together so the accelerator stays busy.
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense.
Readability counts. Special cases aren't special enough to break the rules.
Although practicality beats purity. Errors should never pass silently. Unless explicitly silenced.
In the face of ambiguity, refuse the temptation to guess.
def generate(prompt: str, max_tokens: int = 16) -> list[int]:
    return [token for token in tokenize(prompt)][:max_tokens]
{"name": "weir", "version": 1, "tags": ["router", "engine", "cache"], "ok": true, "score": 0.5}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 1e9.
Hello, world! How are you today? I am fine, thank you. Let us write some tests for the engine.
"""


def train_byte_level_bpe(
    lines: Iterable[str],
    special_tokens: Sequence[str],
    vocab_size: int,
    model: models.Model | None = None,
    pre_tokenizer: pre_tokenizers.PreTokenizer | None = None,
) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `lines`, its special tokens first
    (ids 0, 1, ...): `model` (a `models.BPE()` by default) split by `pre_tokenizer` (GPT-2's
    ByteLevel regex by default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE() if model is None else model)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False) if pre_tokenizer is None else pre_tokenizer
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def build_tokenizer(out_dir: Path) -> Path:
    """Train a small byte-level BPE on the built-in text and write tokenizer.json and
    tokenizer_config.json (ChatML template, bos `<|endoftext|>`, eos `<|im_end|>`) to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_byte_level_bpe(_CORPUS.splitlines(keepends=True), SPECIAL_TOKENS, _VOCAB_SIZE)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def model_config(arch: Arch, **overrides: Any) -> dict[str, Any]:
    """config.json contents for a tiny model of `arch`; `overrides` replace any field."""
    common: dict[str, Any] = {
        "vocab_size": _VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
    }
    if arch == "llama":
        config = {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 16}
        config.update(attention_bias=False, mlp_bias=False)
    elif arch == "qwen2":
        config = {**common, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
        config.update(tie_word_embeddings=True, use_sliding_window=False, sliding_window=None)
    elif arch == "qwen3":
        # head_dim 32, not hidden_size / heads = 16, as in the released Qwen3 sizes.
        config = {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32}
        config.update(
            tie_word_embeddings=True, attention_bias=False, use_sliding_window=False, sliding_window=None
        )
    elif arch == "qwen3_moe":
        # Three layers: a dense one (mlp_only_layers), then routed experts in every layer after.
        config = {
            **common,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "head_dim": 32,
        }
        config.update(
            num_hidden_layers=3,
            tie_word_embeddings=False,
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            router_aux_loss_coef=0.001,
            output_router_logits=False,
        )
    elif arch == "deepseek_v3":
        config = {**common, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
        config.update(
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            num_nextn_predict_layers=0,
            rope_interleave=True,
            attention_bias=False,
        )
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {get_args(Arch)}")
    config.update(overrides)
    return config


def build_checkpoint(out_dir: Path, arch: Arch = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight `arch` checkpoint plus the tiny tokenizer into `out_dir`; return it.

    `overrides` replace config fields (e.g. `hidden_size=256, num_hidden_layers=4`)."""
    from safetensors.torch import save_file

    config = model_config(arch, **overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: _init(name, shape, generator) for name, shape in _param_shapes(arch, config)}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir


def build_mtp_checkpoint(out_dir: Path, hidden_weight: float = 0.0, seed: int = 0) -> Path:
    """A one-layer DeepSeek-V3 whose MTP layer predicts well: random MTP weights would draft
    the right token about once in a vocabulary's size, so no draft would ever be accepted.

    The MTP layer is a copy of the decoder layer, fed the next token's embedding (rows of unit
    RMS, so the layer sees what the model's own layer sees) and `hidden_weight` times the main
    model's hidden state, with the model's own head. At position i it then attends over tokens
    2 .. i + 1 at their relative positions, as the decoder layer at position i + 1 attends over
    tokens 0 .. i + 1, and so drafts nearly the model's next-but-one token (with weight 0);
    a larger `hidden_weight` makes the hidden state matter, at the price of more rejections."""
    from safetensors.torch import load_file, save_file

    build_checkpoint(
        out_dir, "deepseek_v3", seed, num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=1
    )
    tensors = load_file(out_dir / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    embed = tensors["model.embed_tokens.weight"] = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True))
    hidden = embed.shape[1]
    mtp = "model.layers.1."
    for name in [n for n in tensors if n.startswith("model.layers.0.")]:
        tensors[name.replace("model.layers.0.", mtp)] = tensors[name].clone()
    tensors.update(
        {
            f"{mtp}embed_tokens.weight": embed.clone(),
            f"{mtp}enorm.weight": torch.ones(hidden),
            f"{mtp}hnorm.weight": torch.ones(hidden),
            f"{mtp}eh_proj.weight": torch.cat([torch.eye(hidden), hidden_weight * torch.eye(hidden)], dim=1),
            f"{mtp}shared_head.norm.weight": tensors["model.norm.weight"].clone(),
            f"{mtp}shared_head.head.weight": tensors["lm_head.weight"].clone(),
        }
    )
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * torch.randn(shape, generator=generator)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=generator)
    if "embed_tokens" in name:
        return torch.randn(shape, generator=generator)
    if name == "lm_head.weight" or name.endswith("shared_head.head.weight"):  # logits with std ~4
        return 4.0 * torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
    # Linear weights [out, in]: unit-variance outputs for unit-variance inputs.
    return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])


def _param_shapes(arch: Arch, c: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The parameter names and shapes of the Hugging Face implementation of `arch`."""
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    yield "model.embed_tokens.weight", (vocab, hidden)
    yield "model.norm.weight", (hidden,)
    if not c["tie_word_embeddings"]:
        yield "lm_head.weight", (vocab, hidden)
    mtp_layers = c.get("num_nextn_predict_layers", 0) if arch == "deepseek_v3" else 0
    for i in range(c["num_hidden_layers"] + mtp_layers):
        prefix = f"model.layers.{i}"
        if i >= c["num_hidden_layers"]:  # a multi-token-prediction layer's own parts
            yield f"{prefix}.embed_tokens.weight", (vocab, hidden)
            yield f"{prefix}.enorm.weight", (hidden,)
            yield f"{prefix}.hnorm.weight", (hidden,)
            yield f"{prefix}.eh_proj.weight", (hidden, 2 * hidden)
            yield f"{prefix}.shared_head.norm.weight", (hidden,)
            yield f"{prefix}.shared_head.head.weight", (vocab, hidden)
        yield f"{prefix}.input_layernorm.weight", (hidden,)
        yield f"{prefix}.post_attention_layernorm.weight", (hidden,)
        if arch == "deepseek_v3":
            yield from _mla_shapes(f"{prefix}.self_attn", c)
            if i >= c["first_k_dense_replace"]:
                yield from _moe_shapes(f"{prefix}.mlp", c)
            else:
                yield from _mlp_shapes(f"{prefix}.mlp", hidden, c["intermediate_size"])
        else:
            yield from _attention_shapes(f"{prefix}.self_attn", c, qkv_bias=arch == "qwen2")
            if arch in ("qwen3", "qwen3_moe"):
                head_dim = c["head_dim"]
                yield f"{prefix}.self_attn.q_norm.weight", (head_dim,)
                yield f"{prefix}.self_attn.k_norm.weight", (head_dim,)
            if (
                arch == "qwen3_moe"
                and i not in c["mlp_only_layers"]
                and (i + 1) % c["decoder_sparse_step"] == 0
            ):
                yield f"{prefix}.mlp.gate.weight", (c["num_experts"], hidden)
                for e in range(c["num_experts"]):
                    yield from _mlp_shapes(f"{prefix}.mlp.experts.{e}", hidden, c["moe_intermediate_size"])
            else:
                yield from _mlp_shapes(f"{prefix}.mlp", hidden, c["intermediate_size"])


def _attention_shapes(
    prefix: str, c: dict[str, Any], qkv_bias: bool
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Llama-style q/k/v/o projections; `attention_bias` puts biases on all four (Llama, Qwen3),
    `qkv_bias` on q/k/v alone (Qwen2)."""
    hidden, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    o_bias = bool(c.get("attention_bias"))
    for proj, out in (
        ("q_proj", heads * head_dim),
        ("k_proj", kv_heads * head_dim),
        ("v_proj", kv_heads * head_dim),
    ):
        yield f"{prefix}.{proj}.weight", (out, hidden)
        if qkv_bias or o_bias:
            yield f"{prefix}.{proj}.bias", (out,)
    yield f"{prefix}.o_proj.weight", (hidden, heads * head_dim)
    if o_bias:
        yield f"{prefix}.o_proj.bias", (hidden,)


def _mlp_shapes(prefix: str, hidden: int, intermediate: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield f"{prefix}.gate_proj.weight", (intermediate, hidden)
    yield f"{prefix}.up_proj.weight", (intermediate, hidden)
    yield f"{prefix}.down_proj.weight", (hidden, intermediate)


def _mla_shapes(prefix: str, c: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    qk_head_dim = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    if c["q_lora_rank"] is None:
        yield f"{prefix}.q_proj.weight", (heads * qk_head_dim, hidden)
    else:
        yield f"{prefix}.q_a_proj.weight", (c["q_lora_rank"], hidden)
        yield f"{prefix}.q_a_layernorm.weight", (c["q_lora_rank"],)
        yield f"{prefix}.q_b_proj.weight", (heads * qk_head_dim, c["q_lora_rank"])
    yield f"{prefix}.kv_a_proj_with_mqa.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], hidden)
    yield f"{prefix}.kv_a_layernorm.weight", (c["kv_lora_rank"],)
    yield f"{prefix}.kv_b_proj.weight", (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
    yield f"{prefix}.o_proj.weight", (hidden, heads * c["v_head_dim"])


def _moe_shapes(prefix: str, c: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    hidden, experts, inter = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    yield f"{prefix}.gate.weight", (experts, hidden)
    yield f"{prefix}.gate.e_score_correction_bias", (experts,)
    for e in range(experts):  # per-expert names, as DeepSeek's released checkpoints store them
        yield from _mlp_shapes(f"{prefix}.experts.{e}", hidden, inter)
    yield from _mlp_shapes(f"{prefix}.shared_experts", hidden, inter * c["n_shared_experts"])
