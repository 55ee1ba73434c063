"""Block hashing: the one contract the engine, the router and KVBM all key their caches by.

A token sequence is cut into blocks of `block_size` tokens; a partial tail block is not
hashed for the prefix cache (it is still being filled), though `tail_hash` names it for a KV
transfer. Block i's sequence hash is XXH3-64 over block i's tokens as little-endian u32,
seeded with block i-1's hash. The chain starts at 1337, or, when a LoRA name or cache salt
is present, at XXH3-64(salt as UTF-8, seed=1337). A sequence hash therefore names a block
together with its whole prefix, and a flat map from sequence hash serves as a prefix index.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

ROOT_SEED = 1337
_xxh3 = xxhash.xxh3_64_intdigest


def root_hash(salt: str | None = None) -> int:
    """The seed for the first block: 1337, or the salt's hash when one is given."""
    return ROOT_SEED if not salt else _xxh3(salt.encode(), seed=ROOT_SEED)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    parent: int | None = None,
) -> list[int]:
    """Sequence hashes of every full block of `token_ids`.

    `parent` continues a chain: pass the last hash already known to hash only new blocks."""
    # One conversion of the whole list to u32 words, viewed as bytes without a copy.
    return hash_words(_words(token_ids), block_size, salt, parent)


def hash_words(
    data: bytes | memoryview, block_size: int, salt: str | None = None, parent: int | None = None
) -> list[int]:
    """`block_hashes` of tokens already laid out as little-endian u32 words (a tail shorter
    than a block is not hashed)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    view, step = memoryview(data).cast("B"), block_size * 4
    seed = root_hash(salt) if parent is None else parent
    out: list[int] = []
    for start in range(0, len(view) // step * step, step):  # a memoryview slice copies nothing
        seed = _xxh3(view[start : start + step], seed)  # positional: no keyword parsing per block
        out.append(seed)
    return out


def _words(token_ids: Sequence[int]) -> memoryview:
    if isinstance(token_ids, list):
        # A tokenizer hands over a list; `fromlist` converts it about a quarter faster than
        # the constructor, which iterates it as a generic sequence.
        words = array("I")
        words.fromlist(token_ids)
    else:
        words = array("I", token_ids)
    if sys.byteorder != "little":
        words.byteswap()
    return memoryview(words).cast("B")


def tail_hash(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> int | None:
    """A name for the partial block after the full blocks of `token_ids`, None when there is
    none: XXH3-64 of its tokens seeded with the last full block's hash. Never a prefix-cache
    key; disaggregation names a prompt's last, partial block by it, so that a decode worker
    loads that KV too and starts with a decode step instead of recomputing the tail."""
    n_full = len(token_ids) // block_size * block_size
    if n_full == len(token_ids):
        return None
    full = block_hashes(token_ids[:n_full], block_size, salt)
    return _xxh3(_words(token_ids[n_full:]), seed=full[-1] if full else root_hash(salt))


def prompt_block_names(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The hashes of a prompt's full blocks, then its partial block's `tail_hash` if it has one:
    what a KV transfer of the whole prompt names."""
    names = block_hashes(token_ids, block_size, salt)
    tail = tail_hash(token_ids, block_size, salt)
    return names if tail is None else [*names, tail]
