"""`weir serve --backend vllm`: the embedded frontend and one vLLM worker in one command, queried
with the official openai client, then stopped by SIGTERM."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import openai
import pytest

from tests.cli.procs import stop, wait_banner, weir_process
from tests.servers import free_port
from tests.vllm.conftest import BLOCK_SIZE, engine_args, require_vllm

require_vllm()

pytestmark = pytest.mark.slow


def test_weir_serve_with_the_vllm_backend(smollm2_dir: Path, tmp_path: Path) -> None:
    engine = {k: v for k, v in engine_args(smollm2_dir).items() if k not in ("model", "block_size")}
    log = tmp_path / "serve.log"
    port = free_port()
    argv = ["serve", "--backend", "vllm", "--model", str(smollm2_dir), "--served-model-name", "smol"]
    argv += ["--block-size", str(BLOCK_SIZE), "--vllm-engine-args", json.dumps(engine), "--port", str(port)]
    with weir_process(*argv, log=log) as proc:
        url = wait_banner(proc, log, timeout=300)
        assert "(1 vllm worker at" in log.read_text()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["smol"]
        stream = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert text and usage is not None and 0 < usage.completion_tokens <= 8
        assert stop(proc, signal.SIGTERM, timeout=60) == 0
