"""The order in which llama.cpp walks its `token_to_id` map: a libstdc++ `std::unordered_map<std::string, int>`.

llama.cpp detects EOT / EOM / FIM tokens by their text while iterating that map (llama-vocab.cpp, load: "auto-detect
special tokens by text"), so with several candidates (SmolLM2's <|endoftext|> and <|im_end|>, gpt-oss's
<|endoftext|> and <|end|>) the one found first depends on the hash table's layout. This module replays it:

- `std::hash<std::string>` is libstdc++'s `_Hash_bytes` (a MurmurHash64A variant, seed 0xc70f6907);
- the map is filled one token at a time, in id order (`token_to_id[word] = i`; a repeated text keeps its node);
- buckets grow by `_Prime_rehash_policy` (max load factor 1: the count after 13 buckets is the first prime of
  `__prime_list` at least twice the old one, `BUCKET_COUNTS`) when the count of nodes would pass the count of
  buckets, and nodes are linked as `_Hashtable` links them: one forward list, a node for an empty bucket goes to
  the front of the list, any other to the front of its bucket's run, and a rehash relinks the old list in order
  by the same two rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["BUCKET_COUNTS", "iteration_order", "std_hash"]

_MUL = np.uint64(0xC6A4A7935BD1E995)
_SEED = 0xC70F6907
_47 = np.uint64(47)

# libstdc++'s bucket counts for a map grown one insertion at a time (`_M_next_bkt(2 * count)` over __prime_list)
BUCKET_COUNTS = (
    13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933, 351061, 712697, 1447153,
    2938679, 5967347, 12117689, 24607243, 49969847, 101473717, 206062531, 418451333, 849749479, 1725587117,
    3504151727, 8589934583,
)  # fmt: skip


def _shift_mix(v: np.ndarray) -> np.ndarray:
    return v ^ (v >> _47)


def std_hash(texts: Sequence[bytes]) -> np.ndarray:
    """u64[n]: `std::hash<std::string>` of each text on 64-bit libstdc++ (`_Hash_bytes(p, len, 0xc70f6907)`)."""
    n = len(texts)
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=n)
    starts = np.zeros(n, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    blob = np.frombuffer(b"".join(texts) + bytes(8), dtype=np.uint8)
    with np.errstate(over="ignore"):
        h = np.uint64(_SEED) ^ (lengths.astype(np.uint64) * _MUL)
        blocks = lengths // 8
        for j in range(int(blocks.max(initial=0))):  # one 8-byte little-endian word of every text that has it
            rows = np.flatnonzero(blocks > j)
            h[rows] = (h[rows] ^ (_shift_mix(_load(blob, starts[rows] + 8 * j, 8) * _MUL) * _MUL)) * _MUL
        tail = lengths % 8
        rows = np.flatnonzero(tail)
        if rows.size:
            h[rows] = (h[rows] ^ _load(blob, starts[rows] + 8 * blocks[rows], tail[rows])) * _MUL
        return _shift_mix(_shift_mix(h) * _MUL)


def _load(blob: np.ndarray, at: np.ndarray, count) -> np.ndarray:
    """The little-endian u64 of `count` bytes (8, or 1-7 per row) from each offset of `at`."""
    word = np.zeros(len(at), np.uint64)
    for k in range(8):
        byte = blob[at + k].astype(np.uint64)
        if not isinstance(count, int):
            byte[count <= k] = 0
        word |= byte << np.uint64(8 * k)
    return word


def iteration_order(texts: Sequence[str]) -> list[int]:
    """The ids of a vocabulary in the order `for (const auto & t : token_to_id)` visits them in llama.cpp.

    Each distinct text appears once, with the last id that has it (the map's value). Replayed one bucket count
    at a time rather than node by node: after the rehash that sets a bucket count, the list is the buckets' runs,
    the run whose bucket was filled last first, and in each run the node added last first, where the rehash adds
    the old list's nodes in its order and later insertions come after them.
    """
    first: dict[str, int] = {}
    value: list[int] = []
    for i, text in enumerate(texts):
        node = first.setdefault(text, len(first))
        if node == len(value):
            value.append(i)
        else:
            value[node] = i
    codes = std_hash([t.encode() for t in first])
    n = len(codes)
    position = np.zeros(0, np.int64)  # of the nodes inserted so far, in the current list
    for n_buckets in BUCKET_COUNTS:  # the count set when node `len(position)` is inserted (`_M_need_rehash`)
        old, end = len(position), min(n, n_buckets)
        added = np.concatenate([position, np.arange(old, end)])
        bucket = (codes[:end] % np.uint64(n_buckets)).astype(np.int64)
        filled = np.full(n_buckets, end, np.int64)
        np.minimum.at(filled, bucket, added)
        order = np.lexsort((-added, -filled[bucket]))
        position = np.empty(end, np.int64)
        position[order] = np.arange(end)
        if end == n:
            break
    return [value[k] for k in np.argsort(position).tolist()]
