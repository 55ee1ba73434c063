"""Where the frontend reads a model's tokenizer: the directory the worker's card names when
this machine has it (`weir serve`, a shared volume), else the tokenizer files fetched once
from a worker (`model_files` on the request plane) into a local cache.

Cached directories are named by model and a hash of the files' contents, so a model whose
tokenizer changes gets a new directory and two frontends sharing a cache agree on it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from orchestrator.runtime.model_files import TOKENIZER_FILES
from orchestrator.runtime.protocol import ModelFiles
from orchestrator.runtime.request_plane import WorkerClient

log = logging.getLogger("weir.frontend")

FETCH_TIMEOUT_S = 60.0
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def cache_root(configured: str | None) -> Path:
    """`configured`, else `$WEIR_CACHE_DIR/tokenizers`, else `~/.cache/weir/tokenizers`."""
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get("WEIR_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "weir") / "tokenizers"


async def tokenizer_dir(model: str, model_path: str, worker: WorkerClient, root: Path) -> Path:
    """A local directory holding the tokenizer of `model`, whose workers read it from `model_path`."""
    local = Path(model_path)
    # In a thread: the path may be on a network mount, and a stat there can take a while.
    if await asyncio.to_thread((local / "tokenizer.json").is_file):
        return local
    async with asyncio.timeout(FETCH_TIMEOUT_S):
        files = await worker.model_files()
    path = await asyncio.to_thread(store, root, model, files)
    log.info("%s is not readable here: using the tokenizer fetched from a worker, in %s", model_path, path)
    return path


def store(root: Path, model: str, files: ModelFiles) -> Path:
    """Write `files` under `root` (once per content) and return their directory."""
    unexpected = sorted(set(files.files) - set(TOKENIZER_FILES))
    if unexpected:  # names become paths: accept the known ones only
        raise ValueError(f"a worker sent unexpected model files {unexpected}")
    if "tokenizer.json" not in files.files:
        raise FileNotFoundError(f"the worker of {model} has no tokenizer.json in its model directory")
    digest = hashlib.sha256()
    for name in sorted(files.files):
        content = files.files[name]
        digest.update(b"%s\0%d\0" % (name.encode(), len(content)))
        digest.update(content)
    target = root / f"{_UNSAFE.sub('_', model)}-{digest.hexdigest()[:16]}"
    if (target / "tokenizer.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed into place: a reader never sees half a directory.
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        for name, content in files.files.items():
            (partial / name).write_bytes(content)
        try:
            partial.rename(target)
        except OSError:
            if not (target / "tokenizer.json").is_file():
                raise
            # Another frontend sharing the cache stored the same files first.
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target
