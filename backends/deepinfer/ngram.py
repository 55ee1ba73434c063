"""Draft tokens without a draft model: n-gram (prompt lookup) speculation, as vLLM's `ngram`.

Text that repeats what came before (code being edited, a summary quoting its source, a
template filled in) continues the way it did last time. The proposer takes the longest
suffix of the sequence, from `max_n` tokens down to `min_n`, that occurred earlier, and
proposes the up to `k` tokens that followed its latest earlier occurrence. The engine then
verifies them in one forward pass (scheduler.py); a wrong guess costs only its share of that
pass. Nothing here touches torch.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        if k < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, max_n={max_n}")
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """At most `min(k, limit)` tokens that may follow `tokens`; [] when no suffix recurs."""
        k = min(self.k, limit)
        length = len(tokens)
        if k <= 0 or length <= self.min_n:
            return []
        last = tokens[-1]
        # Ends of earlier occurrences of the last token, latest first: the only places a
        # matching suffix can end.
        ends = [i for i in range(length - 2, -1, -1) if tokens[i] == last]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            for end in ends:
                if end + 1 >= n and tokens[end + 1 - n : end + 1] == suffix:
                    return list(tokens[end + 1 : end + 1 + k])
        return []
