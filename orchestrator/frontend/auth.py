"""Bearer-token check for the API.

With `FrontendConfig.api_key` set, every request except the probes and the scrape
(`/health`, `/live`, `/metrics`) must carry `Authorization: Bearer <key>`; anything else gets
401 with OpenAI's `invalid_api_key` error before its body is read. Guarding all but an
allowlist, rather than matching `/v1/`, leaves no path spelling that slips through. A plain
ASGI wrapper: one header scan and a constant-time compare per request."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp

from orchestrator.frontend.asgi import JSON_HEADERS, Receive, Scope, Send
from orchestrator.frontend.errors import FrontendError, error_body

OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})


class InvalidApiKey(FrontendError):
    status = 401

    def __init__(self) -> None:
        super().__init__(
            "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
        )


_BODY = error_body(InvalidApiKey())
_HEADERS = [
    *JSON_HEADERS,
    (b"content-length", str(len(_BODY)).encode()),
    (b"www-authenticate", b'Bearer realm="weir"'),
]


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        # A key read from a file or a Secret often ends in a newline no client sends.
        self._key = api_key.strip().encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self._allowed(scope):
            await send({"type": "http.response.start", "status": 401, "headers": _HEADERS})
            await send({"type": "http.response.body", "body": _BODY, "more_body": False})
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        # compare_digest takes as long whatever the token, so timing reveals nothing of the key.
        return hmac.compare_digest(token.strip(), self._key) and scheme.lower() == b"bearer"
