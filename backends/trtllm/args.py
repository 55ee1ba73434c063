"""TensorRT-LLM's command-line flags and its `BackendSpec`. Imports no TensorRT-LLM: --help
stays cheap."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from backends.adapter import json_object, owned_fields
from backends.registry import BackendSpec
from orchestrator.runtime.engine import Engine

# LLM (LlmArgs) fields Weir sets itself: from its own flags, or because the adapter needs
# them as they are (token ids in, KV events and iteration stats out).
OWNED_LLM_ARGS = {
    "model": "--model",
    "max_batch_size": "--max-num-seqs",
    "max_num_tokens": "--max-num-batched-tokens",
    "skip_tokenizer_init": "the adapter (the frontend owns all text)",
    "enable_iter_perf_stats": "the adapter (load reports read TensorRT-LLM's iteration stats)",
}
# KvCacheConfig fields Weir sets itself.
OWNED_KV_CACHE_CONFIG = {
    "tokens_per_block": "--block-size",
    "enable_block_reuse": "the adapter (the router needs prefix reuse and its events)",
    "event_buffer_max_size": "the adapter (it relays TensorRT-LLM's KV events)",
}

# The LLM fields the shared flags set (the block size lives in kv_cache_config).
_SHARED_FIELDS = {"max_num_seqs": "max_batch_size", "max_num_batched_tokens": "max_num_tokens"}


def add_trtllm_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("TensorRT-LLM engine")
    g.add_argument(
        "--trtllm-llm-args",
        type=_llm_args,
        default={},
        metavar="JSON",
        help="TensorRT-LLM LLM(...) arguments as a JSON object, as its LLM API and "
        "trtllm-serve's YAML name them, e.g. "
        '\'{"tensor_parallel_size": 2, "kv_cache_config": {"free_gpu_memory_fraction": 0.5}}\'; '
        "block size and batch limits come from the shared flags",
    )


def _llm_args(text: str) -> dict[str, Any]:
    value = json_object(text, "LLM arguments")
    kv = value.get("kv_cache_config", {})
    if not isinstance(kv, dict):
        raise argparse.ArgumentTypeError("kv_cache_config must be a JSON object of KvCacheConfig fields")
    problems = owned_fields(value, OWNED_LLM_ARGS)
    problems += owned_fields(kv, OWNED_KV_CACHE_CONFIG, prefix="kv_cache_config.")
    if problems:
        raise argparse.ArgumentTypeError("; ".join(problems))
    return value


def trtllm_llm_args(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """The LLM arguments for this worker, but those the adapter adds at start; its
    kv_cache_config is a field map of KvCacheConfig."""
    fields: dict[str, Any] = {**args.trtllm_llm_args, "model": str(model_dir)}
    for name, field in _SHARED_FIELDS.items():
        if getattr(args, name) is not None:
            fields[field] = getattr(args, name)
    kv = dict(fields.get("kv_cache_config", {}))
    if args.block_size is not None:
        kv["tokens_per_block"] = args.block_size
    fields["kv_cache_config"] = kv
    return fields


def _build(args: argparse.Namespace, model_dir: Path, served_name: str) -> Engine:
    from backends.trtllm.engine import TrtllmWorker  # TensorRT-LLM, once it is the backend

    return TrtllmWorker(trtllm_llm_args(args, model_dir), served_name)


SPEC = BackendSpec(
    description="TensorRT-LLM's LLM API in the worker process (pip install tensorrt-llm; NVIDIA GPUs)",
    add_arguments=add_trtllm_arguments,
    # TensorRT-LLM's own choices (KvCacheConfig's 32 tokens per block, its batch limits);
    # the card reports them.
    defaults={"block_size": None, "max_num_seqs": None, "max_num_batched_tokens": None},
    build=_build,
    roles=("aggregated",),
)
