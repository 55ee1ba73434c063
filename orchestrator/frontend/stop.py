"""Stop strings over streamed text.

Text arrives in arbitrary pieces, so a stop string may straddle two deltas. The matcher holds
back the longest tail of the text seen so far that is a prefix of some stop string, emits the
rest, and once a stop string appears it emits the text before it and reports the match. Cost
per delta is O(len(delta) + sum of stop lengths) string work, all in C.
"""

from __future__ import annotations


class StopStringMatcher:
    """Per-request state. After a match, further `feed` calls return ("", True)."""

    __slots__ = ("_chars", "_held", "_include_stop", "_max_hold", "_stopped", "_stops")

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = list(dict.fromkeys(stops))
        self._include_stop = include_stop
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        # A tail can only begin a stop string if its last character occurs in one: the usual
        # case (no such character) then costs one set lookup.
        self._chars = frozenset("".join(self._stops))
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string matched)."""
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        end = self._first_match(buffer)
        if end is not None:
            self._stopped = True
            self._held = ""
            return buffer[:end], True
        hold = self._held_length(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """At the end of generation: whatever was held back, since no stop string can follow."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_match(self, buffer: str) -> int | None:
        """The end of the emitted text for the earliest stop string in `buffer`, if any."""
        best: tuple[int, int] | None = None
        for stop in self._stops:
            at = buffer.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, len(stop))
        if best is None:
            return None
        return best[0] + best[1] if self._include_stop else best[0]

    def _held_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that begins some stop string."""
        if not buffer or buffer[-1] not in self._chars:
            return 0
        for length in range(min(self._max_hold, len(buffer)), 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
