"""A frontend that cannot read the worker's model directory fetches the tokenizer from it.

The end-to-end test runs `weir frontend` and a mocker worker as separate processes over real
etcd, NATS and TCP. The worker's card names a relative model path, resolved in the worker's
own working directory, so the frontend's process cannot see it: as when they run in
different pods."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import openai
import pytest

from orchestrator.frontend.preprocessor import Preprocessor
from orchestrator.frontend.tokenizer_files import store
from orchestrator.runtime.model_files import read_model_files
from orchestrator.runtime.protocol import ModelFiles
from tests.cli.procs import REPO, wait_healthy, weir_process
from tests.frontend.tokenizer_dirs import build_chatml
from tests.servers import free_port

MODEL = "remote-model"
WORKER = """
import asyncio, sys
from backends.mocker.config import MockerConfig
from backends.mocker.engine import MockerEngine
from tokenizers import Tokenizer
from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.events import make_event_plane
from orchestrator.runtime.worker_host import WorkerHost, serve_workers

async def main():
    etcd, nats, namespace = sys.argv[1:4]
    # The worker checks prompt ids against its vocabulary: it must be the tokenizer's.
    vocab = Tokenizer.from_file("tok/tokenizer.json").get_vocab_size(with_added_tokens=True)
    config = MockerConfig(model_name="remote-model", model_path="tok", speedup=1000, vocab_size=vocab)
    discovery, events = make_discovery(etcd, namespace), make_event_plane(nats)
    await serve_workers([WorkerHost(MockerEngine(config), discovery, events, namespace)], drain_timeout=5)
    await asyncio.gather(discovery.close(), events.close())

asyncio.run(main())
"""


def test_chat_with_a_tokenizer_only_the_worker_can_read(etcd_url: str, nats_url: str, tmp_path: Path) -> None:
    worker_cwd = tmp_path / "worker-pod"
    model_dir = build_chatml(worker_cwd / "tok")
    (model_dir / "model.safetensors").write_bytes(b"\0" * 4096)  # weights: must not travel
    cache = tmp_path / "frontend-cache"
    namespace = f"mf{uuid.uuid4().hex[:6]}"
    port = free_port()
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, etcd_url, nats_url, namespace],
        cwd=worker_cwd,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    try:
        assert not (REPO / "tok").exists()  # the frontend's working directory has no such path
        log = tmp_path / "frontend.log"
        argv = ["frontend", "--etcd", etcd_url, "--nats", nats_url, "--weir-namespace", namespace]
        with weir_process(*argv, "--port", str(port), log=log, env={"WEIR_CACHE_DIR": str(cache)}) as proc:
            base_url = f"http://127.0.0.1:{port}"
            wait_healthy(base_url, proc, log, timeout=60)
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)
            messages = [{"role": "user", "content": "Hello world! How are you today?"}]
            out = client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=5,
                extra_body={"ignore_eos": True},
            )
            assert out.choices[0].finish_reason == "length"
            # The prompt was tokenized with the worker's tokenizer and template.
            local = Preprocessor.load(model_dir)
            assert out.usage is not None
            assert out.usage.prompt_tokens == len(local.encode(local.render_chat(messages), False))
    finally:
        worker.terminate()
        worker.wait(timeout=20)
    [cached] = cache.joinpath("tokenizers").iterdir()
    assert cached.name.startswith(f"{MODEL}-")
    assert sorted(p.name for p in cached.iterdir()) == [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert cached.joinpath("tokenizer.json").read_bytes() == model_dir.joinpath("tokenizer.json").read_bytes()


@pytest.fixture
def files(tmp_path: Path) -> ModelFiles:
    model_dir = build_chatml(tmp_path / "model")
    (model_dir / "model.safetensors").write_bytes(b"weights")
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    return read_model_files(str(model_dir))


def test_only_tokenizer_files_are_read(files: ModelFiles) -> None:
    assert sorted(files.files) == [
        "chat_template.jinja",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert read_model_files(None).files == {}


def test_store_is_keyed_by_content_and_written_once(files: ModelFiles, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    first = store(root, "org/model", files)
    assert first.parent == root and first.name.startswith("org_model-")
    assert store(root, "org/model", files) == first
    changed = ModelFiles(files={**files.files, "chat_template.jinja": b"{{ 'other' }}"})
    assert store(root, "org/model", changed) != first
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [first.name, store(root, "org/model", changed).name]
    )
    assert Preprocessor.load(first).render_chat([{"role": "user", "content": "hi"}]) == "hi"


@pytest.mark.parametrize(
    ("sent", "error"),
    [
        ({"tokenizer.json": b"{}", "../escape": b"x"}, ValueError),
        ({"tokenizer.json": b"{}", "model.safetensors": b"x"}, ValueError),
        ({"tokenizer_config.json": b"{}"}, FileNotFoundError),
    ],
)
def test_store_rejects_what_a_worker_must_not_send(
    sent: dict[str, bytes], error: type[Exception], tmp_path: Path
) -> None:
    with pytest.raises(error):
        store(tmp_path, "m", ModelFiles(files=sent))
    assert list(tmp_path.iterdir()) == []
