"""vLLM's command-line flags and its `BackendSpec`. Imports no vLLM: --help stays cheap."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from backends.adapter import engine_fields
from backends.registry import BackendSpec
from orchestrator.runtime.engine import Engine

# AsyncEngineArgs fields Weir sets itself: from its own flags, or because the adapter needs
# them as they are (token ids in, events out, stats for load reports).
OWNED_ENGINE_ARGS = {
    "model": "--model",
    "served_model_name": "--served-model-name",
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "kv_events_config": "the adapter (it relays vLLM's KV events)",
    "disable_log_stats": "the adapter (load reports read vLLM's scheduler stats)",
    "skip_tokenizer_init": "the adapter",
}


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM engine")
    g.add_argument(
        "--vllm-engine-args",
        type=engine_fields("AsyncEngineArgs fields", OWNED_ENGINE_ARGS),
        default={},
        metavar="JSON",
        help="vLLM AsyncEngineArgs fields as a JSON object, as `vllm serve` names them, e.g. "
        '\'{"max_model_len": 2048, "enforce_eager": true, "gpu_memory_utilization": 0.3}\' '
        "(dashes or underscores); block size and batch limits come from the shared flags",
    )


def vllm_engine_args(args: argparse.Namespace, model_dir: Path, served_name: str) -> dict[str, Any]:
    """The AsyncEngineArgs fields for this worker, but those the adapter adds at start."""
    fields: dict[str, Any] = {"model": str(model_dir), "served_model_name": served_name}
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    # Requests carry their own priority (Weir's `priority` field): vLLM honours it only
    # under its priority policy, which orders equal priorities by arrival, as FCFS does.
    return {"scheduling_policy": "priority", **args.vllm_engine_args, **fields}


def _build(args: argparse.Namespace, model_dir: Path, served_name: str) -> Engine:
    # vLLM configures its own loggers from the environment when first imported, in this
    # process and in the engine processes it starts: as quiet as Weir's unless asked.
    quiet = logging.getLogger().getEffectiveLevel() > logging.INFO
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if quiet else "INFO")
    from backends.vllm.worker import VllmWorker  # vLLM, once it is the backend

    return VllmWorker(vllm_engine_args(args, model_dir, served_name), served_name)


SPEC = BackendSpec(
    description="vLLM's v1 engine in the worker process (pip install 'weir[vllm]')",
    add_arguments=add_vllm_arguments,
    # vLLM's own choices: its block size depends on the platform and attention backend (16 on
    # GPUs, 128 on CPU, where it must be a multiple of 32); the card reports what it chose.
    defaults={"block_size": None, "max_num_seqs": None, "max_num_batched_tokens": None},
    build=_build,
    roles=("aggregated",),
)
