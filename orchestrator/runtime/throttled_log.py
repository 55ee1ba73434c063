"""A warning that repeats while something is down (every retry fails the same way), logged
once per few seconds instead of once per retry."""

from __future__ import annotations

import logging
import time


class ThrottledWarning:
    def __init__(self, log: logging.Logger, every_s: float = 5.0) -> None:
        self.log = log
        self.every_s = every_s
        self._last = 0.0

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last > self.every_s:
            self._last = now
            self.log.warning(message, *args)
