"""A WorkerRequest for adapter translation tests: three prompt tokens, ten to generate, and
whatever fields a test sets."""

from __future__ import annotations

from orchestrator.runtime.protocol import WorkerRequest


def request(**kw: object) -> WorkerRequest:
    fields: dict[str, object] = {"request_id": "r1", "token_ids": [5, 6, 7], "max_tokens": 10}
    fields.update(kw)
    return WorkerRequest(**fields)  # type: ignore[arg-type]
