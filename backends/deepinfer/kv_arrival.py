"""Onboarded KV arriving in the cache one layer at a time, beside the forward pass.

A prefix hit on a lower tier brings whole blocks (every layer's K and V) back into the cache.
Written before the forward, the copy adds its full time to the step. Written layer by layer
on a loader thread (`PagedKVCache.start_write`), layer i's attention waits only for layer
i's blocks while the loader still writes the layers after it, so the copy hides behind the
compute of the layers before (LMCache's layer-wise onboarding does the same with CUDA
streams). On the CPU the two run on two cores: torch releases the GIL in its kernels.

Each layer touches only its own cache tensors, and the layer that waits for its blocks is the
only user of those tensors in the forward, so the loader and the forward never use one
tensor at the same time. On CUDA the loader only enqueues its copies, on a stream of its own
from pinned host memory (`PagedKVCache`), and marks a layer written with a function that makes
the waiter's stream wait for that layer's copies: the forward's kernels queue behind them on the
GPU while the host goes on launching, and the copies overlap the kernels of the layers before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class KVArrival:
    """Which layers' arriving blocks are in the cache. The loader marks layers in order."""

    def __init__(self, num_layers: int) -> None:
        self._written = [threading.Event() for _ in range(num_layers)]
        self._order: list[Callable[[], None] | None] = [None] * num_layers
        self._error: BaseException | None = None

    def mark_written(self, layer: int, order: Callable[[], None] | None = None) -> None:
        """`layer`'s copies are issued; `order`, when given, is called by every waiter for
        them (on a GPU: its stream waits for the copies, which may still be running)."""
        self._order[layer] = order
        self._written[layer].set()

    def fail(self, error: BaseException) -> None:
        """The loader stopped: no waiter may hang, and each one raises `error`."""
        self._error = error
        for written in self._written:
            written.set()

    def wait(self, layer: int) -> None:
        """Until `layer`'s blocks are written; the loader's error if it failed."""
        self._written[layer].wait()
        if self._error is not None:
            raise RuntimeError("loading KV blocks into the cache failed") from self._error
        order = self._order[layer]
        if order is not None:
            order()

    def wait_all(self) -> None:
        self.wait(len(self._written) - 1)
