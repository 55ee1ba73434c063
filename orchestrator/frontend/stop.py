"""Stop strings over streamed text.

The output ends where the earliest-starting occurrence of any stop string begins (at equal
starts, the shortest one wins, which matters only with include_stop): exactly what matching
the whole text at once gives, as OpenAI and vLLM do. Text arrives in arbitrary pieces, so a
stop string may straddle two deltas, and a stop string that is complete may still lose to a
longer one that began earlier and has not finished arriving (stops "a" and "\\naa" on the
text "\\na" + "a"). The matcher therefore holds back the longest tail of the text seen so far
that is a proper prefix of some stop string, and reports a match only when no such pending
tail starts before it. Cost per delta is O(len(delta) + sum of stop lengths) string work,
all in C, and the held tail is shorter than the longest stop string.
"""

from __future__ import annotations


class StopStringMatcher:
    """Per-request state. After a match, further `feed` calls return ("", True)."""

    __slots__ = ("_chars", "_held", "_include_stop", "_max_hold", "_stopped", "_stops")

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        # Shortest first, so the first stop found at a given start is the shortest there.
        self._stops = sorted(dict.fromkeys(stops), key=len)
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

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string matched). `final`: no more
        text follows, so nothing is held back and a pending longer stop can no longer win."""
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        hold = 0 if final else self._held_length(buffer)
        pending = len(buffer) - hold  # where a stop string that may still complete begins
        match = self._earliest_match(buffer)
        if match is not None and match[0] <= pending:
            self._stopped = True
            self._held = ""
            start, stop = match
            return buffer[: start + len(stop) if self._include_stop else start], True
        self._held = buffer[pending:]
        return buffer[:pending], False

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the earliest complete stop string in `buffer`, if any."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = buffer.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _held_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        if not buffer or buffer[-1] not in self._chars:
            return 0
        for length in range(min(self._max_hold, len(buffer)), 0, -1):
            tail = buffer[-length:]
            if any(len(stop) > length and stop.startswith(tail) for stop in self._stops):
                return length
        return 0
