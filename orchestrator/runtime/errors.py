"""The one exception for a request that failed, from the engine to the frontend.

An engine raises it for a request it rejects or cannot finish; a request-plane handler
raises it to send a typed error frame; on the caller's side every failure (an error frame,
a lost connection, an unreachable worker) arrives as one. `code` is the protocol's
`ErrorCode`; `retryable` says whether the same request may go to another worker."""

from __future__ import annotations

from orchestrator.runtime.protocol import ErrorCode, WorkerError


class EngineError(Exception):
    def __init__(self, code: ErrorCode, message: str, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ErrorCode = code
        self.message = message
        self.retryable = retryable

    @classmethod
    def from_wire(cls, error: WorkerError) -> EngineError:
        return cls(error.code, error.message, error.retryable)

    def to_wire(self) -> WorkerError:
        return WorkerError(code=self.code, message=self.message, retryable=self.retryable)


def unavailable(message: str) -> EngineError:
    """The worker cannot be reached: another may serve the request."""
    return EngineError("unavailable", message, retryable=True)
