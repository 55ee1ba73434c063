"""`/openapi.json` for the whole API, generation routes included.

The generation routes are plain ASGI (app.py), so FastAPI does not see their bodies; their
request schemas are generated here from the same pydantic models the handlers validate with,
so the schema cannot drift from what the server accepts."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from orchestrator.frontend.protocol import ChatCompletionRequest, CompletionRequest

GENERATION_ROUTES: dict[str, tuple[type[BaseModel], str]] = {
    "/v1/chat/completions": (ChatCompletionRequest, "A chat completion, streamed as SSE with stream=true"),
    "/v1/completions": (CompletionRequest, "A text completion, streamed as SSE with stream=true"),
}
_REF = "#/components/schemas/{model}"
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERROR_STATUSES = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "408": "The body did not arrive in time",
    "413": "Body too large",
    "503": "No worker available",
    "504": "Timed out",
}


def _operation(model: type[BaseModel], summary: str) -> dict[str, Any]:
    error = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
    return {
        "summary": summary,
        "operationId": model.__name__,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
        },
        "responses": {
            "200": {
                "description": "The completion (application/json), or its chunks (text/event-stream)",
                "content": {"application/json": {"schema": {"type": "object"}}},
            },
            **{status: {"description": what, "content": error} for status, what in _ERROR_STATUSES.items()},
        },
    }


def build_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of the ordinary routes plus the generation routes."""
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, defs = models_json_schema(
        [(model, "validation") for model, _ in GENERATION_ROUTES.values()], ref_template=_REF
    )
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    paths = spec.setdefault("paths", {})
    for path, (model, summary) in GENERATION_ROUTES.items():
        paths[path] = {"post": _operation(model, summary)}
    return spec


class WeirApp(FastAPI):
    """FastAPI whose `openapi()` (served at /openapi.json and behind /docs) is `build_schema`."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            self.openapi_schema = build_schema(self)
        return self.openapi_schema
