from __future__ import annotations

import random
from collections.abc import Mapping

from router.protocols import Decision, RouteRequest, WorkerLoad


class RandomPolicy:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, request: RouteRequest, workers: Mapping[str, WorkerLoad]) -> Decision:
        return Decision(self._rng.choice(sorted(workers)))
