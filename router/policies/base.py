"""The interface every routing mode implements."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from router.protocols import Decision, RouteRequest, WorkerLoad


class Policy(Protocol):
    def select(self, request: RouteRequest, workers: Mapping[str, WorkerLoad]) -> Decision:
        """Pick one of `workers` (never empty; draining workers already removed)."""
        ...
