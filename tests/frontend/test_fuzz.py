"""Schema-driven fuzzing: schemathesis generates requests from the frontend's own /openapi.json
for the two generation routes and sends them to a real `weir serve --backend mocker`; none may
get a 5xx. The schema's `model` is pinned to the served model, so most requests get past the
model lookup to the code that matters (a random name is only ever a 404)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.cli.procs import wait_healthy, weir_process
from tests.servers import free_port

pytestmark = pytest.mark.slow

# Examples per route and phase: enough for schemathesis to reach every field and its edges,
# bounded so the run stays near a minute on the 2-core development machine.
MAX_EXAMPLES = 200


def test_generation_routes_never_answer_5xx(tmp_path_factory: pytest.TempPathFactory) -> None:
    port = free_port()
    log = tmp_path_factory.mktemp("fuzz") / "serve.log"
    args = ["serve", "--backend", "mocker", "--speedup", "1000", "--workers", "1", "--port", str(port)]
    with weir_process(*args, log=log) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, proc, log)
        schema = httpx.get(f"{base_url}/openapi.json", timeout=10).json()
        assert {"/v1/chat/completions", "/v1/completions"} <= set(schema["paths"])
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        for request in ("ChatCompletionRequest", "CompletionRequest"):
            schema["components"]["schemas"][request]["properties"]["model"] = {"enum": [model]}
        schema_file = log.with_name("openapi.json")
        schema_file.write_text(json.dumps(schema))
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "run",
                str(schema_file),
                "--url",
                base_url,
                "--checks",
                "not_a_server_error",
                "--include-path-regex",
                "^/v1/(chat/)?completions$",
                "--max-examples",
                str(MAX_EXAMPLES),
                "--seed",
                "1",
                "--request-timeout",
                "30",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
            cwd=log.parent,  # schemathesis keeps its example database in the working directory
        )
        assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
        assert proc.poll() is None, "the server died under fuzzing"
    assert "Traceback" not in log.read_text()
