"""keep_large_buffers: a large host buffer comes from the heap, not from a fresh mmap.

Each case runs in a fresh interpreter, since the setting is the process's for life."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bytes glibc holds in mmapped chunks, before and while a 64 MiB tensor lives: above the
# largest mmap threshold glibc ever picks by itself (32 MiB).
_PROBE = """
import ctypes, sys
import torch
from backends.deepinfer.host_memory import keep_large_buffers

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2
kept = keep_large_buffers() if sys.argv[1] == "keep" else None
before = mallinfo2().hblkhd
buffer = torch.empty(64 << 20, dtype=torch.uint8)
print(kept, mallinfo2().hblkhd - before)
"""

glibc = pytest.mark.skipif(
    not hasattr(os, "confstr") or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's malloc only"
)


def _probe(mode: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    kept, mmapped = out.stdout.split()
    return kept, int(mmapped)


@glibc
def test_a_large_buffer_is_mmapped_by_default() -> None:
    # The baseline the other test differs from: without the call, glibc maps the buffer.
    kept, mmapped = _probe("default")
    assert kept == "None" and mmapped >= 64 << 20


@glibc
def test_kept_large_buffers_come_from_the_heap() -> None:
    assert _probe("keep") == ("True", 0)
