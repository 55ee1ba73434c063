"""Every example in helm/weir/examples/ deploys only pools that Weir serves at this commit:
each rendered worker's command line parses with `weir worker`'s real parser, names a backend
it builds and a role a router serves, and a model whose architecture DeepInfer runs."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from backends.deepinfer.models.registry import MODELS
from backends.registry import BACKENDS
from orchestrator.cli.main import build_parser
from router.table import ROUTABLE_ROLES
from tests.k8s.helm import EXAMPLES, find, render

# Model families the examples use -> the config.json architecture their checkpoints declare.
ARCHITECTURES = {
    "Qwen3-": "Qwen3ForCausalLM",
    "Qwen2.5-": "Qwen2ForCausalLM",
    "Llama-": "LlamaForCausalLM",
    "Mistral-": "MistralForCausalLM",
    "DeepSeek-V3": "DeepseekV3ForCausalLM",
}


def worker_args(argv: list[str]) -> argparse.Namespace:
    assert argv[0] == "worker", argv
    return build_parser(only="worker").parse_args(argv)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_pools_are_served(helm_bin: str, example: Path) -> None:
    pools = [
        d
        for d in find(render(helm_bin, example), "Deployment")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    ]
    assert pools, f"{example.name} deploys no worker pool"
    for pool in pools:
        (container,) = pool["spec"]["template"]["spec"]["containers"]
        args = worker_args(container["args"])
        assert args.backend in BACKENDS
        assert args.role in ROUTABLE_ROLES, f"{example.name}: role {args.role} is not routed"
        if args.backend == "deepinfer":
            family = re.sub(r"^.*/", "", args.model)
            arch = next((a for prefix, a in ARCHITECTURES.items() if family.startswith(prefix)), None)
            assert arch in MODELS, f"{example.name}: DeepInfer does not run {args.model}"
