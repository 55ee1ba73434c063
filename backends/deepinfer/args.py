"""DeepInfer's command-line flags, shared by `weir serve` and `weir worker`.

Kept apart from `worker.py` so that parsing a command line (or printing its help) does not
import torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from backends.deepinfer.config import EngineConfig


def add_deepinfer_arguments(parser: argparse.ArgumentParser) -> None:
    """DeepInfer's flags, in their own group; defaults are `EngineConfig`'s."""
    d = EngineConfig()
    g = parser.add_argument_group("DeepInfer engine")
    g.add_argument(
        "--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct, converted once)"
    )
    g.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: the directory name)"
    )
    g.add_argument(
        "--block-size", type=int, default=d.block_size, help=f"tokens per KV block (default {d.block_size})"
    )
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
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help=f"running sequences (default {d.max_num_seqs})",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help=f"tokens per step (default {d.max_num_batched_tokens})",
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
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--seed", type=int, default=d.seed, help="seed for unseeded sampling")
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


def deepinfer_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """An `EngineConfig` from the flags above; converts the default model on first use."""
    if args.model:
        model = Path(args.model)
    else:
        from backends.deepinfer.smollm2 import ensure_default_model

        model = ensure_default_model()
    if not (model / "config.json").is_file():
        raise ValueError(f"--model {model} is not a checkpoint directory (no config.json)")
    return EngineConfig(
        model=str(model),
        served_model_name=args.served_model_name or "",
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        deterministic=args.deterministic,
        seed=args.seed,
        host_cache_gb=args.host_cache_gb,
        disk_cache_dir=args.disk_cache_dir,
        disk_cache_gb=args.disk_cache_gb,
        disk_cache_min_reuse=args.disk_cache_min_reuse,
        redis_url=args.redis_url,
    )
