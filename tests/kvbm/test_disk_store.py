"""DiskStore against a real slab file: what the engine relies on is that a block comes back
intact or not at all, across evictions, restarts, damage and a full disk."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbm.disk import DiskStore

LAYOUT = 0x1234
BLOCK = 5000  # not a multiple of 4096: the slot is padded
ROOT = Path(__file__).resolve().parents[2]


def block(i: int, size: int = BLOCK) -> bytes:
    return (f"block-{i:04d}:".encode() * (size // 11 + 1))[:size]


@pytest.fixture(params=[True, False], ids=["o_direct", "buffered"])
def o_direct(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def test_round_trip(tmp_path: Path, o_direct: bool) -> None:
    store = DiskStore(tmp_path, 4, BLOCK, LAYOUT, o_direct=o_direct)
    if not o_direct:
        assert not store.direct  # with it, the filesystem decides: either is valid
    assert store.put(1, block(1)) == []
    assert 1 in store and 2 not in store and len(store) == 1
    assert store.get(1) == block(1)
    assert store.get(2) is None
    assert store.put(1, block(1)) == []  # present: a no-op
    assert len(store) == 1
    with pytest.raises(ValueError):
        store.put(3, b"short")
    store.close()


def test_lru_eviction_returns_the_evicted_hash(tmp_path: Path, o_direct: bool) -> None:
    store = DiskStore(tmp_path, 2, BLOCK, LAYOUT, o_direct=o_direct)
    store.put(1, block(1))
    store.put(2, block(2))
    assert store.get(1) == block(1)  # 2 is now the least recently used
    assert store.put(3, block(3)) == [2]
    assert sorted(store.hashes()) == [1, 3]
    assert store.get(3) == block(3) and store.get(1) == block(1)
    store.close()


CRASH = """
import os, signal, sys
from pathlib import Path
from kvbm.disk import DiskStore
from tests.kvbm.test_disk_store import BLOCK, LAYOUT, block
store = DiskStore(Path(sys.argv[1]), 8, BLOCK, LAYOUT, o_direct=sys.argv[2] == "1")
for i in range(5):
    store.put(i, block(i))
store.discard(4)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_reopening_finds_the_blocks_again(tmp_path: Path, o_direct: bool) -> None:
    # Written by a process killed without closing anything: only what is in the file counts.
    crashed = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path), str(int(o_direct))], cwd=ROOT)
    assert crashed.returncode == -signal.SIGKILL
    reopened = DiskStore(tmp_path, 8, BLOCK, LAYOUT, o_direct=o_direct)
    assert sorted(reopened.hashes()) == [0, 1, 2, 3]  # and the discarded 4 stays discarded
    for i in range(4):
        assert reopened.get(i) == block(i)
    # The free slots were found too: filling the store evicts only once it is full.
    assert [reopened.put(i, block(i)) for i in range(10, 14)] == [[], [], [], []]
    assert len(reopened.put(14, block(14))) == 1
    reopened.close()


def test_a_flipped_byte_is_a_miss_and_the_block_is_gone(tmp_path: Path, o_direct: bool) -> None:
    store = DiskStore(tmp_path, 4, BLOCK, LAYOUT, o_direct=o_direct)
    store.put(7, block(7))
    store.put(8, block(8))
    flip_a_byte(store, 7)
    assert store.get(7) is None
    assert 7 not in store and store.get(8) == block(8)
    store.close()
    assert 7 not in DiskStore(tmp_path, 4, BLOCK, LAYOUT, o_direct=o_direct)


def flip_a_byte(store: DiskStore, i: int) -> None:
    data = store.path.read_bytes()
    at = data.index(f"block-{i:04d}:".encode()) + 100
    with store.path.open("r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x01]))


def test_a_prefix_is_read_in_runs_of_adjacent_slots_up_to_the_first_miss(
    tmp_path: Path, o_direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path, 8, BLOCK, LAYOUT, o_direct=o_direct)
    for i in range(8):
        store.put(i, block(i))
    store.discard(2)
    store.put(20, block(20))  # slot 2, between blocks 1 and 3
    reads: list[int] = []
    preadv = os.preadv
    monkeypatch.setattr(
        os, "preadv", lambda fd, buffers, offset: reads.append(offset) or preadv(fd, buffers, offset)
    )
    prefix = [0, 1, 3, 4, 5, 6, 7]  # slots 0 and 1, then 3 to 7: two reads
    assert store.get_prefix(prefix) == [block(i) for i in prefix]
    assert reads == [0, 3 * store.slot_bytes]
    assert store.get_prefix([0, 1, 9, 3]) == [block(0), block(1)]  # 9 is not held: the prefix ends
    assert store.get_prefix([9, 0]) == []
    store.close()


def test_blocks_put_together_go_in_one_write_a_run_of_adjacent_slots(
    tmp_path: Path, o_direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path, 6, BLOCK, LAYOUT, o_direct=o_direct)
    writes: list[tuple[int, int]] = []
    pwrite = os.pwrite
    monkeypatch.setattr(
        os, "pwrite", lambda fd, data, offset: writes.append((offset, len(data))) or pwrite(fd, data, offset)
    )
    assert store.put_blocks([(i, block(i)) for i in range(4)]) == []
    assert writes == [(0, 4 * store.slot_bytes)]  # free slots 0-3: one write
    writes.clear()
    # 1 is held already (it only becomes the most recent); 4 and 5 fill the last free slots,
    # then 6 and 7 evict the least recent, 0 and 2, whose slots are not adjacent.
    assert store.put_blocks([(1, block(1)), (4, block(4)), (5, block(5)), (6, block(6)), (7, block(7))]) == [
        0,
        2,
    ]
    assert writes == [
        (4 * store.slot_bytes, 2 * store.slot_bytes),
        (0, store.slot_bytes),
        (2 * store.slot_bytes, store.slot_bytes),
    ]
    assert store.hashes() == [3, 1, 4, 5, 6, 7]
    store.close()
    reopened = DiskStore(tmp_path, 6, BLOCK, LAYOUT, o_direct=o_direct)
    assert all(reopened.get(h) == block(h) for h in (1, 3, 4, 5, 6, 7))
    # More blocks than the disk holds: the last of them.
    assert sorted(reopened.put_blocks([(i, block(i)) for i in range(10, 20)])) == [1, 3, 4, 5, 6, 7]
    assert sorted(reopened.hashes()) == list(range(14, 20))
    with pytest.raises(ValueError):
        reopened.put_blocks([(30, block(30)), (31, b"short")])
    assert 30 not in reopened  # a batch with a bad block stores none of it
    reopened.close()


def test_a_damaged_block_ends_the_prefix_and_is_dropped_alone(tmp_path: Path, o_direct: bool) -> None:
    store = DiskStore(tmp_path, 6, BLOCK, LAYOUT, o_direct=o_direct)
    for i in range(6):
        store.put(i, block(i))
    flip_a_byte(store, 3)
    assert store.get_prefix(list(range(6))) == [block(0), block(1), block(2)]
    assert 3 not in store
    # The blocks read with it in its run are intact, and the slot of the damaged one is free.
    assert store.get_prefix([4, 5]) == [block(4), block(5)]
    assert store.put(30, block(30)) == [] and store.get(30) == block(30)
    store.close()


def test_another_layout_is_a_miss(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 4, BLOCK, LAYOUT)
    store.put(1, block(1))
    store.close()
    other = DiskStore(tmp_path, 4, BLOCK, LAYOUT + 1)
    assert 1 not in other and other.get(1) is None
    other.close()
    # Even the same file under the other layout's name holds nothing for it: headers are checked.
    shutil.copy(store.path, other.path)
    other = DiskStore(tmp_path, 4, BLOCK, LAYOUT + 1)
    assert len(other) == 0 and other.get(1) is None
    other.close()
    # And a block size that differs from the file's is no match either.
    smaller = DiskStore(tmp_path, 4, BLOCK - 1, LAYOUT)
    assert len(smaller) == 0
    smaller.close()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, so that the disk really fills; needs root and a working mount."""
    mount = shutil.which("mount")
    if os.geteuid() != 0 or mount is None:
        pytest.skip("a full disk is tested on a tiny tmpfs, which needs root to mount")
    target = tmp_path / "tiny"
    target.mkdir()
    done = subprocess.run([mount, "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_a_full_disk_stores_what_fits_and_warns_once(
    tiny_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvbm.disk")
    size = 8000  # 8 KiB slots: 16 of them would need 128 KiB
    store = DiskStore(tiny_tmpfs, 16, size, LAYOUT)
    evicted = [h for i in range(40) for h in store.put(i, block(i, size))]
    assert 0 < len(store) < 16
    assert store.capacity_blocks == len(store)  # shrunk to what the disk holds
    retired = 16 - store.capacity_blocks
    assert len(evicted) == 40 - retired - len(store)  # every put that found room stored its block
    for h in store.hashes():
        assert store.get(h) == block(h, size)
    assert store.hashes()[-1] == 39  # still taking blocks, by evicting within what fits
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    store.close()


def test_a_full_disk_takes_what_fits_of_blocks_put_together(tiny_tmpfs: Path) -> None:
    size = 8000  # as above: 16 slots of 8 KiB do not fit
    store = DiskStore(tiny_tmpfs, 16, size, LAYOUT)
    evicted = store.put_blocks([(i, block(i, size)) for i in range(16)])
    assert evicted == [] and 0 < len(store) < 16  # the run did not fit: its slots one at a time
    assert store.capacity_blocks == len(store)
    assert all(store.get(h) == block(h, size) for h in store.hashes())
    assert store.put_blocks([(i, block(i, size)) for i in range(100, 103)]) != []  # evicting within it
    assert all(h in store for h in (100, 101, 102))
    store.close()


def test_a_disk_with_no_room_at_all_stores_nothing(
    tiny_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvbm.disk")
    with (tiny_tmpfs / "filler").open("wb", buffering=0) as f, pytest.raises(OSError):
        while True:
            f.write(bytes(4096))
    store = DiskStore(tiny_tmpfs, 4, BLOCK, LAYOUT)
    assert [store.put(i, block(i)) for i in range(10)] == [[]] * 10
    assert len(store) == 0 and store.capacity_blocks == 0 and store.get(0) is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    store.close()
