"""What Weir's engine adapters (`backends/vllm`, `backends/sglang`, `backends/trtllm`) share.

Each adapter wraps an engine Weir does not bundle: its `args.py` passes the engine's own
arguments through as one JSON object (`engine_fields`), its `params.py` translates requests
(`new_tokens` applies what every one of them refuses or shortens) and its worker is an
`AggregatedAdapter`: role aggregated only, no KV transfers, KV events from a `KvMirror`.
Imports no engine.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from backends.kv_events import KvMirror
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.model_files import eos_token_ids
from orchestrator.runtime.protocol import KvEventBatch, KvSnapshot, ModelCard, WorkerRequest


def json_object(text: str, what: str) -> dict[str, Any]:
    """`text` as a JSON object, for an argparse `type`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of {what}")
    return value


def owned_fields(names: Iterable[str], owned: Mapping[str, str], prefix: str = "") -> list[str]:
    """One complaint per field in `names` that Weir sets itself (`owned`: field -> what sets it)."""
    return [f"{prefix}{name} is set by {owned[name]}" for name in sorted(set(names) & set(owned))]


def engine_fields(what: str, owned: Mapping[str, str]) -> Callable[[str], dict[str, Any]]:
    """An argparse `type` for an engine's own arguments as one JSON object, its keys spelled
    with dashes or underscores as the engine's CLI and Python API do; refuses the fields
    Weir sets itself, naming the flag that does."""

    def parse(text: str) -> dict[str, Any]:
        fields = {str(key).replace("-", "_"): item for key, item in json_object(text, what).items()}
        problems = owned_fields(fields, owned)
        if problems:
            raise argparse.ArgumentTypeError("; ".join(problems))
        return fields

    return parse


def prompt_tokens(request: WorkerRequest) -> list[int]:
    """What the engine prefills: the prompt, then any tokens an earlier worker generated."""
    return [*request.token_ids, *request.generated_token_ids]


def block_size_mismatch(engine: str, chosen: int, wanted: int | None) -> str | None:
    """Why the engine cannot serve, if it chose another block size than --block-size asked:
    the router hashes prompts at the card's block size."""
    if wanted is None or wanted == chosen:
        return None
    return (
        f"{engine} chose block size {chosen}, not --block-size {wanted}: the router hashes "
        "prompts at the card's block size, so they must be equal"
    )


def new_tokens(request: WorkerRequest, engine: str) -> tuple[int, int]:
    """(most, fewest) tokens the engine is to generate for `request`, less any an earlier worker
    generated (migration). Refuses, as `invalid_request`, what no adapter serves: a
    disaggregated request, a structured-output request resumed mid-grammar (no engine resumes
    a grammar from given tokens), and a migrated one with nothing left to generate."""
    if request.prefill_only or request.kv_transfer is not None:
        raise EngineError(
            "invalid_request", f"the {engine} adapter serves aggregated requests only (no disaggregation)"
        )
    done = len(request.generated_token_ids)
    if done and request.guided is not None:
        raise EngineError(
            "invalid_request", f"{engine} cannot resume a structured-output request mid-way (migration)"
        )
    most = request.max_tokens - done
    if most < 1:
        raise EngineError(
            "invalid_request",
            f"max_tokens {request.max_tokens} leaves nothing to generate after {done} migrated tokens",
        )
    return most, max(request.min_tokens - done, 0)


# Characters with a meaning in a regex; escaped one by one, because Python's `re.escape` also
# escapes spaces and other literals that not every engine's grammar backend accepts.
_REGEX_META = set("\\.^$*+?{}[]|()/")


def choice_regex(choices: object) -> str:
    """A regex matching exactly one of `choices`, for engines without a choice constraint."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise EngineError("invalid_request", "a choice constraint needs a non-empty list of strings")
    literal = ("".join("\\" + ch if ch in _REGEX_META else ch for ch in c) for c in choices)
    return "(" + "|".join(literal) + ")"


def model_eos_ids(model_dir: Path) -> list[int]:
    """The model directory's eos ids, as the frontend reads them (none without tokenizer.json)."""
    path = model_dir / "tokenizer.json"
    return eos_token_ids(model_dir, Tokenizer.from_file(str(path))) if path.is_file() else []


class AggregatedAdapter:
    """The parts of an adapter's `Engine` that every adapter has alike: the card once started,
    no KV transfers (its spec serves role aggregated only), KV events from a `KvMirror`, and
    the prompt tokens of requests still waiting for their first token (engines report how many
    requests wait, not their tokens, and the router weighs queued prefill)."""

    engine_name = "the engine"  # as messages name it: "vLLM", "SGLang", "TensorRT-LLM"

    def __init__(self) -> None:
        self._card: ModelCard | None = None
        self._mirror: KvMirror | None = None
        self._waiting_first: dict[str, int] = {}

    @property
    def card(self) -> ModelCard:
        if self._card is None:
            raise EngineError(
                "unavailable", f"the {self.engine_name} worker has not been started", retryable=True
            )
        return self._card

    def read_transfer(self, transfer_id: str) -> list[bytes] | None:
        return None  # nothing is ever held for a transfer

    def release_transfer(self, transfer_id: str) -> None:
        pass

    def _poll_events(self) -> None:
        """Bring the mirror up to date (an adapter whose events arrive on a socket reads it)."""

    def take_kv_events(self) -> list[KvEventBatch]:
        if self._mirror is None:
            return []
        self._poll_events()
        return self._mirror.take_events()

    def kv_snapshot(self) -> KvSnapshot:
        if self._mirror is None:
            return KvSnapshot(worker_id="", event_id=0, blocks={})
        return self._mirror.snapshot()

    @property
    def queued_prefill_tokens(self) -> int:
        return sum(self._waiting_first.values())
