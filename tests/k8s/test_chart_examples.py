"""Every example in helm/weir/examples/ deploys only pools that Weir serves at this commit:
each rendered worker's command line parses with `weir worker`'s real parser, names a backend
it builds and a role a router serves (the pool's own, as its labels say) and that backend
serves, and for DeepInfer a model whose architecture it runs; the frontend's parses with
`weir frontend`'s, and disaggregates when the example has a prefill pool."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from backends.deepinfer.models.registry import MODELS
from backends.registry import BACKENDS, backend_spec
from orchestrator.cli.main import build_parser
from router.table import ROUTABLE_ROLES
from tests.k8s.helm import EXAMPLES, find, one, render

# Model families the examples use -> the config.json architecture their checkpoints declare.
ARCHITECTURES = {
    "Qwen3-": "Qwen3ForCausalLM",
    "Qwen2.5-": "Qwen2ForCausalLM",
    "Llama-": "LlamaForCausalLM",
    "Mistral-": "MistralForCausalLM",
    "DeepSeek-V3": "DeepseekV3ForCausalLM",
}


def parsed_args(deployment: dict[str, Any], command: str) -> argparse.Namespace:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    argv = container["args"]
    assert argv[0] == command, argv
    return build_parser(only=command).parse_args(argv)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_pools_are_served(helm_bin: str, example: Path) -> None:
    manifests = render(helm_bin, example)
    pools = [
        d
        for d in find(manifests, "Deployment")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    ]
    assert pools, f"{example.name} deploys no worker pool"
    frontend = parsed_args(one(manifests, "Deployment", "r-weir-frontend"), "frontend")
    for pool in pools:
        args = parsed_args(pool, "worker")
        assert args.backend in BACKENDS
        assert args.role in ROUTABLE_ROLES, f"{example.name}: role {args.role} is not routed"
        assert args.role == pool["metadata"]["labels"]["weir.dev/role"]
        if args.role == "prefill":
            assert frontend.disaggregation != "never", f"{example.name}: its prefill pool gets no prefill"
        if args.backend == "vllm":  # its flags parsed above; the roles its spec serves
            assert args.role in backend_spec("vllm").roles
            assert args.vllm_engine_args, f"{example.name}: a vLLM pool without engine arguments"
        if args.backend == "deepinfer":
            family = re.sub(r"^.*/", "", args.model)
            arch = next((a for prefix, a in ARCHITECTURES.items() if family.startswith(prefix)), None)
            assert arch in MODELS, f"{example.name}: DeepInfer does not run {args.model}"
