"""DeepInfer's command-line flags and its `BackendSpec`, shared by `weir serve` and `weir worker`.

Kept apart from `worker.py` so that parsing a command line (or printing its help) does not
import torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from backends.deepinfer.block_pool import EVICTIONS
from backends.deepinfer.config import EngineConfig
from backends.registry import BackendSpec
from orchestrator.runtime.engine import Engine

_DEFAULTS = EngineConfig()


def add_deepinfer_arguments(parser: argparse.ArgumentParser) -> None:
    """DeepInfer's own flags, in their own groups (`backends.registry` declares --model and the
    shared ones); defaults are `EngineConfig`'s."""
    d = _DEFAULTS
    g = parser.add_argument_group("DeepInfer engine")
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=d.num_kv_blocks,
        help="KV blocks; 0 sizes from --kv-cache-memory-gb",
    )
    g.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=d.kv_cache_memory_gb,
        help=f"KV cache size (default {d.kv_cache_memory_gb})",
    )
    g.add_argument(
        "--max-model-len", type=int, default=d.max_model_len, help="context limit (0: the checkpoint's)"
    )
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N (default auto)")
    g.add_argument(
        "--dtype",
        default=d.dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant numerics: seeded requests ignore their batch",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run decode steps eagerly instead of replaying them as CUDA graphs",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument(
        "--kv-eviction",
        choices=EVICTIONS,
        default=d.kv_eviction,
        help="which cached KV blocks are evicted first: lru, slru (segmented LRU: blocks a prefix "
        "hit reused are kept through a stream of one-off prompts), or arc (segmented LRU whose "
        "split adapts, as ARC's, to the evicted blocks that come back); the mocker backend simulates "
        f"the same pool and takes it too (default {d.kv_eviction})",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="seed for unseeded sampling")
    g.add_argument(
        "--speculative-config",
        type=speculative_config,
        default={},
        metavar="JSON",
        help="speculative decoding, as vLLM's flag: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}\' drafts up to 4 tokens per decode step from a recurring '
        f"n-gram (lookup sizes default to {d.prompt_lookup_min}..{d.prompt_lookup_max}); "
        '\'{"method": "mtp", "num_speculative_tokens": 3}\' drafts with a DeepSeek-V3 checkpoint\'s '
        "own multi-token-prediction layer (1 token by default); off by default",
    )
    t = parser.add_argument_group("KV tiers below the engine's cache (kvbm)")
    t.add_argument(
        "--host-cache-gb",
        type=float,
        default=d.host_cache_gb,
        help="G2: host memory for KV blocks offloaded from the engine (default 0: no tiers)",
    )
    t.add_argument("--disk-cache-dir", default=None, help="G3: a directory for a slab file of KV blocks")
    t.add_argument("--disk-cache-gb", type=float, default=d.disk_cache_gb, help="G3: its size")
    t.add_argument(
        "--disk-cache-min-reuse",
        type=int,
        default=d.disk_cache_min_reuse,
        help="G3 takes a block host memory drops only once it was loaded back this often "
        f"(default {d.disk_cache_min_reuse})",
    )
    t.add_argument(
        "--redis-url",
        default=None,
        help="G4: a Redis shared by every worker of the model, e.g. redis://kv-cache:6379/0",
    )


_NGRAM_FIELDS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
# vLLM's names for the model's own MTP layers: "mtp", and the older "deepseek_mtp".
_MTP_METHODS = ("mtp", "deepseek_mtp")


def speculative_config(text: str) -> dict[str, Any]:
    """`--speculative-config`'s JSON as `EngineConfig` fields: the n-gram method, which needs no
    draft model, or the checkpoint's own MTP layer."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    method = spec.pop("method", None)
    if method not in ("ngram", *_MTP_METHODS):
        raise argparse.ArgumentTypeError(
            f'method {method!r} is not supported; DeepInfer speculates with "ngram" or "mtp"'
        )
    known = _NGRAM_FIELDS if method == "ngram" else ("num_speculative_tokens",)
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fields {unknown}; known: method, {', '.join(known)}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in spec.values()):
        raise argparse.ArgumentTypeError(f"{', '.join(spec)} must be positive integers")
    if method in _MTP_METHODS:
        spec.setdefault("num_speculative_tokens", 1)
        return {"speculative_method": "mtp", **spec}
    if "num_speculative_tokens" not in spec:
        raise argparse.ArgumentTypeError("the ngram method needs num_speculative_tokens")
    spec.setdefault("prompt_lookup_max", max(_DEFAULTS.prompt_lookup_max, spec.get("prompt_lookup_min", 0)))
    spec.setdefault("prompt_lookup_min", min(_DEFAULTS.prompt_lookup_min, spec["prompt_lookup_max"]))
    if spec["prompt_lookup_min"] > spec["prompt_lookup_max"]:
        raise argparse.ArgumentTypeError("prompt_lookup_min must not exceed prompt_lookup_max")
    return {"speculative_method": "ngram", **spec}


def deepinfer_config_from_args(args: argparse.Namespace, model_dir: Path, served_name: str) -> EngineConfig:
    """An `EngineConfig` serving `model_dir` as `served_name`, from the flags above and the
    shared ones (which `backends.registry.make_engine` fills with DeepInfer's defaults)."""
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {model_dir} is not a checkpoint directory (no config.json)")
    return EngineConfig(
        model=str(model_dir),
        served_model_name=served_name,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_eviction=args.kv_eviction,
        deterministic=args.deterministic,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        host_cache_gb=args.host_cache_gb,
        disk_cache_dir=args.disk_cache_dir,
        disk_cache_gb=args.disk_cache_gb,
        disk_cache_min_reuse=args.disk_cache_min_reuse,
        redis_url=args.redis_url,
        **args.speculative_config,
    )


def _build(args: argparse.Namespace, model_dir: Path, served_name: str) -> Engine:
    from backends.deepinfer.worker import DeepInferWorker  # torch, once DeepInfer is the backend

    config = deepinfer_config_from_args(args, model_dir, served_name)
    return DeepInferWorker(dataclasses.replace(config, worker_id=args.worker_id))


SPEC = BackendSpec(
    description="the bundled PyTorch engine",
    add_arguments=add_deepinfer_arguments,
    defaults={
        "block_size": _DEFAULTS.block_size,
        "max_num_seqs": _DEFAULTS.max_num_seqs,
        "max_num_batched_tokens": _DEFAULTS.max_num_batched_tokens,
    },
    build=_build,
)
