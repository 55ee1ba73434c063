"""Typed errors at the HTTP edge and the one mapping from any exception to OpenAI's error body.

Every failure a client can cause or observe becomes a `FrontendError` with a status, an
OpenAI error `type`, and optionally the offending `param` and a machine-readable `code`.
`to_frontend_error` is the single place that translates library exceptions (pydantic,
router, request plane, timeouts) into those."""

from __future__ import annotations

import logging

import msgspec
import pydantic

from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import ErrorCode
from router.protocols import NoWorkerAvailable

log = logging.getLogger("weir.frontend")


class FrontendError(Exception):
    status = 400
    type = "invalid_request_error"
    headers: tuple[tuple[bytes, bytes], ...] = ()  # extra response headers (Retry-After)

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(FrontendError):
    pass


class ModelNotFound(FrontendError):
    status = 404

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model", code="model_not_found")


class BodyTooLarge(FrontendError):
    status = 413

    def __init__(self, limit: int) -> None:
        super().__init__(f"Request body exceeds {limit} bytes.", code="request_too_large")


class BodyTimeout(FrontendError):
    status = 408

    def __init__(self) -> None:
        super().__init__("The request body did not arrive in time.", code="request_timeout")


class Unavailable(FrontendError):
    status = 503
    type = "service_unavailable_error"


class RateLimited(FrontendError):
    """Admission control turned the request away (admission.py). OpenAI's 429 shape: the
    openai client raises RateLimitError and, honouring Retry-After, retries by itself."""

    status = 429
    type = "requests"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.headers = ((b"retry-after", str(retry_after_s).encode()),)


class ShuttingDown(Unavailable):
    def __init__(self) -> None:
        super().__init__("The server is shutting down; retry the request.", code="shutting_down")


class Timeout(FrontendError):
    status = 504
    type = "timeout_error"


class InternalError(FrontendError):
    status = 500
    type = "internal_server_error"


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


def error_body(err: FrontendError) -> bytes:
    return msgspec.json.encode(_ErrorBody(_ErrorDetail(err.message, err.type, err.param, err.code)))


def _from_validation(exc: pydantic.ValidationError) -> FrontendError:
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return InvalidRequest(f"Malformed JSON body: {first['msg']}", code="invalid_json")
    loc = ".".join(str(p) for p in first["loc"])
    return InvalidRequest(f"{loc}: {first['msg']}" if loc else first["msg"], param=loc or None)


def _from_worker(code: ErrorCode, message: str) -> FrontendError:
    if code == "invalid_request":
        return InvalidRequest(message)
    if code in ("overloaded", "unavailable"):
        return Unavailable(message, code=code)
    return InternalError(message, code=code)


def to_frontend_error(exc: BaseException) -> FrontendError:
    """Map any exception raised while serving a request to a client-facing error."""
    if isinstance(exc, FrontendError):
        return exc
    if isinstance(exc, pydantic.ValidationError):
        return _from_validation(exc)
    if isinstance(exc, NoWorkerAvailable):
        return Unavailable(str(exc) or "No worker is available.", code="no_worker")
    if isinstance(exc, TimeoutError):
        return Timeout("The request timed out.")
    if isinstance(exc, EngineError):
        return _from_worker(exc.code, exc.message)
    log.exception("unexpected error while serving a request", exc_info=exc)
    return InternalError("Internal server error.")
