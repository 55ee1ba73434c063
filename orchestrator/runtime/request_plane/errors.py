"""The one exception type of the request plane, on both sides of the wire."""

from __future__ import annotations

from orchestrator.runtime.protocol import ErrorCode, WorkerError


class RemoteError(Exception):
    """A call failed. Raised by a handler, it travels as an error frame; on the caller's side
    every failure (error frame, lost connection, unreachable worker) arrives as one.
    `retryable` says whether the same request may be sent to another worker."""

    def __init__(self, code: ErrorCode, message: str, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ErrorCode = code
        self.message = message
        self.retryable = retryable

    @property
    def error(self) -> WorkerError:
        return self.to_wire()

    @classmethod
    def from_wire(cls, error: WorkerError) -> RemoteError:
        return cls(error.code, error.message, error.retryable)

    def to_wire(self) -> WorkerError:
        return WorkerError(code=self.code, message=self.message, retryable=self.retryable)


def unavailable(message: str) -> RemoteError:
    return RemoteError("unavailable", message, retryable=True)
