"""Running a test's work on several threads released together."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

WAIT_S = 10.0  # an upper bound on waits for what must happen, never a delay


def at_once(threads: int, work: Callable[[int], None]) -> None:
    """`work(i)` for i in range(threads), each on its own thread, all started together;
    re-raises the first failure."""
    start = threading.Barrier(threads)

    def run(i: int) -> None:
        start.wait(WAIT_S)
        work(i)

    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(run, i) for i in range(threads)]:
            future.result()
