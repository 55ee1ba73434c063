"""Test vectors for the block-hash contract every component keys its cache by."""

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.runtime.hashing import ROOT_SEED, block_hashes, prompt_block_names, root_hash, tail_hash

# Fixed vectors: any change here breaks cache compatibility between engine, router and KVBM.
VECTORS = [
    (list(range(8)), 4, None, [9143094415614847814, 14008802683831594309]),
    (list(range(9)), 4, "lora-a", [7709626215745982769, 6695593556516116261]),
]


def reference(tokens: list[int], block_size: int, salt: str | None) -> list[int]:
    """The blueprint's definition, written out block by block with struct."""
    seed = ROOT_SEED if salt is None else xxhash.xxh3_64_intdigest(salt.encode(), seed=ROOT_SEED)
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        seed = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), seed=seed)
        out.append(seed)
    return out


@pytest.mark.parametrize(("tokens", "block_size", "salt", "expected"), VECTORS)
def test_fixed_vectors(tokens: list[int], block_size: int, salt: str | None, expected: list[int]) -> None:
    assert block_hashes(tokens, block_size, salt=salt) == expected
    assert reference(tokens, block_size, salt) == expected


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    block_size=st.sampled_from([1, 4, 16, 64]),
    salt=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
)
def test_matches_reference(tokens: list[int], block_size: int, salt: str | None) -> None:
    assert block_hashes(tokens, block_size, salt=salt) == reference(tokens, block_size, salt)


@given(tokens=st.lists(st.integers(0, 50_000), min_size=0, max_size=200), cut=st.integers(0, 12))
def test_parent_continues_the_chain(tokens: list[int], cut: int) -> None:
    block_size = 16
    whole = block_hashes(tokens, block_size)
    head = whole[:cut]
    split = min(cut, len(whole)) * block_size
    tail = block_hashes(tokens[split:], block_size, parent=head[-1] if head else None)
    assert head + tail == whole


def test_partial_tail_block_is_not_hashed() -> None:
    assert block_hashes([1, 2, 3], 4) == []
    assert block_hashes(list(range(7)), 4) == block_hashes(list(range(4)), 4)


def test_salt_separates_chains_and_empty_salt_is_none() -> None:
    assert root_hash("a") != root_hash("b") != ROOT_SEED
    assert root_hash("") == ROOT_SEED
    assert block_hashes([1, 2, 3, 4], 4, salt="a") != block_hashes([1, 2, 3, 4], 4)


def test_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)


def test_a_partial_block_is_named_apart_from_every_full_one() -> None:
    tokens = list(range(40))
    full = block_hashes(tokens, 16)
    tail = tail_hash(tokens, 16)
    assert tail is not None and tail not in full
    assert tail == tail_hash(tokens, 16)  # deterministic, and a function of the whole prefix
    assert tail != tail_hash([1, *tokens[1:]], 16) and tail != tail_hash(tokens[:39], 16)
    assert tail != tail_hash(tokens, 16, salt="tenant-b")
    assert tail_hash(tokens[:32], 16) is None  # no partial block
    assert tail_hash(tokens[:5], 16) is not None  # a prompt shorter than a block is all tail
    assert prompt_block_names(tokens, 16) == [*full, tail]
    assert prompt_block_names(tokens[:32], 16) == full
