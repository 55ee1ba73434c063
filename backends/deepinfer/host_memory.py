"""Keep the forward pass's large host buffers in the heap, where the next step reuses them.

glibc serves an allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and
unmaps it on free. A forward pass on the CPU allocates such buffers every layer (a 4,096-token
prefill of SmolLM2: 50 MB of gate/up activations per layer), so each came back as untouched
pages, which the kernel zeroed and faulted in, 4 KiB at a time, inside the step. Served from
the heap and never trimmed, freed buffers are reused as they are: a prefill of 32 prompts of
128 tokens on SmolLM2 took a median 13.8 s instead of 15.8 (one thread, in turns,
docs/deepinfer-engine.md).
vLLM's CPU backend gets the same by preloading the tcmalloc it bundles into its workers
(`vllm/platforms/cpu.py`). The cost: the process keeps its peak heap instead of returning it
to the system, as an engine that holds its KV cache for life does anyway."""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("weir.deepinfer")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER = -1  # as the size_t glibc reads: no threshold is ever reached


def keep_large_buffers() -> bool:
    """Serve every allocation from the heap and never trim it; False where the C library is
    not glibc (nothing is changed there)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        libc = ctypes.CDLL("libc.so.6")
    except (ValueError, OSError):  # no such confstr name, or no glibc to load
        return False
    done = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER) == 1
    if not done:
        log.warning("could not tune glibc malloc; large host buffers stay mmapped")
    return done
