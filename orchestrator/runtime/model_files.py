"""A model directory's tokenizer files, read on the worker for a frontend elsewhere.

The frontend owns all text, so it needs each model's tokenizer and chat template; in a
cluster the model directory is on the worker's disk (another pod). The worker host answers
the request plane's `model_files` endpoint with these files, and only these: weights never
travel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

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


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the file is absent (HF model dirs omit freely)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def special_token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a special token either as its text or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def eos_token_ids(model_dir: Path, tokenizer: Tokenizer) -> list[int]:
    """Every id that ends generation: the tokenizer's eos token, then generation_config.json's
    and config.json's `eos_token_id`. Instruct models often end turns with another token than
    the tokenizer's eos (Llama 3's <|eot_id|>), which only generation_config.json lists. The
    frontend and the engines read them here, so both stop on the same ids."""
    ids: list[int] = []
    eos_text = special_token_text(read_json(model_dir / "tokenizer_config.json").get("eos_token"))
    if eos_text is not None and (eos_id := tokenizer.token_to_id(eos_text)) is not None:
        ids.append(eos_id)
    for name in ("generation_config.json", "config.json"):
        value = read_json(model_dir / name).get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)
    return ids
