"""A model directory's tokenizer files, read on the worker for a frontend elsewhere.

The frontend owns all text, so it needs each model's tokenizer and chat template; in a
cluster the model directory is on the worker's disk (another pod). The worker host answers
the request plane's `model_files` endpoint with these files, and only these: weights never
travel."""

from __future__ import annotations

from pathlib import Path

from orchestrator.runtime.protocol import ModelFiles

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "config.json",
    "chat_template.jinja",
)
# One request-plane frame carries them all; the largest real tokenizer.json files are ~35 MB.
MAX_MODEL_FILES_BYTES = 48 * 1024 * 1024


def read_model_files(model_path: str | None) -> ModelFiles:
    """The tokenizer files present in `model_path` (none without a path). Blocking file reads:
    call it in a thread. ValueError if together they would not fit one frame."""
    files: dict[str, bytes] = {}
    if model_path:
        root = Path(model_path)
        for name in TOKENIZER_FILES:
            path = root / name
            if path.is_file():
                files[name] = path.read_bytes()
    total = sum(len(content) for content in files.values())
    if total > MAX_MODEL_FILES_BYTES:
        raise ValueError(
            f"the tokenizer files of {model_path} take {total} bytes, over {MAX_MODEL_FILES_BYTES}"
        )
    return ModelFiles(files=files)
