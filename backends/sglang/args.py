"""SGLang's command-line flags and its `BackendSpec`. Imports no SGLang: --help stays cheap."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from backends.adapter import engine_fields
from backends.registry import BackendSpec
from orchestrator.runtime.engine import Engine

# ServerArgs fields Weir sets itself: from its own flags, or because the adapter needs them as
# they are (cumulative streamed outputs, its tokenizer for min_new_tokens, events out).
OWNED_SERVER_ARGS = {
    "model_path": "--model",
    "served_model_name": "--served-model-name",
    "page_size": "--block-size",
    "max_running_requests": "--max-num-seqs",
    "chunked_prefill_size": "--max-num-batched-tokens",
    "kv_events_config": "the adapter (it relays SGLang's KV events)",
    "incremental_streaming_output": "the adapter (it reads cumulative outputs)",
    "skip_tokenizer_init": "the adapter (SGLang needs its tokenizer for min_new_tokens)",
}

# Shared flag -> the ServerArgs field that means the same. SGLang's chunked prefill size is
# the most prompt tokens one step prefills, as vLLM's max_num_batched_tokens is.
_SHARED_FIELDS = {
    "block_size": "page_size",
    "max_num_seqs": "max_running_requests",
    "max_num_batched_tokens": "chunked_prefill_size",
}


def add_sglang_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("SGLang engine")
    g.add_argument(
        "--sglang-server-args",
        type=engine_fields("ServerArgs fields", OWNED_SERVER_ARGS),
        default={},
        metavar="JSON",
        help="SGLang ServerArgs fields as a JSON object, as `sglang serve` names them, e.g. "
        '\'{"mem_fraction_static": 0.5, "context_length": 4096, "device": "cuda"}\' '
        "(dashes or underscores); page size and batch limits come from the shared flags",
    )


def sglang_server_args(args: argparse.Namespace, model_dir: Path, served_name: str) -> dict[str, Any]:
    """The ServerArgs fields for this worker, but those the adapter adds at start.

    Weir's `priority` orders lower values first, as vLLM's and DeepInfer's do; SGLang's
    priority scheduling orders higher values first unless told otherwise, so the adapter
    turns it on in Weir's direction, 0 by default as Weir's (the JSON may still turn it off).
    SGLang takes it with the fcfs and lof policies only."""
    fields: dict[str, Any] = {"model_path": str(model_dir), "served_model_name": served_name}
    for name, field in _SHARED_FIELDS.items():
        if getattr(args, name) is not None:
            fields[field] = getattr(args, name)
    defaults = {
        "enable_priority_scheduling": True,
        "schedule_low_priority_values_first": True,
        "default_priority_value": 0,
    }
    return {**defaults, **args.sglang_server_args, **fields}


def _build(args: argparse.Namespace, model_dir: Path, served_name: str) -> Engine:
    from backends.sglang.engine import SglangWorker  # SGLang, once it is the backend

    return SglangWorker(sglang_server_args(args, model_dir, served_name), served_name)


SPEC = BackendSpec(
    description="SGLang's offline engine in the worker process (pip install sglang; GPUs)",
    add_arguments=add_sglang_arguments,
    # SGLang's own choices: its page size (1 unless an attention backend needs more), running
    # requests and chunk size follow the device and its memory; the card reports them.
    defaults={"block_size": None, "max_num_seqs": None, "max_num_batched_tokens": None},
    build=_build,
    roles=("aggregated",),
)
