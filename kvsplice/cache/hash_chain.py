"""vLLM V1's automatic prefix caching: a chained hash per full block, in plain Python.

Each full block of a request gets a hash over (its parent block's hash, its token ids, extra
keys); the first block's parent is a fixed seed and its extra keys carry the request's namespace,
so the hash of block j names the whole prefix 0 .. (j+1)·B-1 in that namespace. The cache is a map
from hash to the blocks that hold that prefix. It keeps no references: a released block goes to
the allocator's free queue with its content, and its entry is dropped by an eviction hook only
when the allocator hands the block out again (vLLM's lazy eviction). A hit takes the block back
out of the free queue, which is vLLM's "touch": it will be released again later, at the LRU tail.

As in vLLM, blocks are never de-duplicated: two requests that compute the same block at the same
time both register it under one hash (block tables stay append-only); a lookup takes the first
registered one, and each copy is dropped on its own eviction.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable
from dataclasses import dataclass, field

from kvsplice.cache.base import CacheSeq, PrefixCache, PrefixHit
from kvsplice.kv.allocator import BlockAllocator

# vLLM's NONE_HASH, the parent of every first block. vLLM draws it at random unless PYTHONHASHSEED
# is set; a fixed value keeps hashes reproducible across processes and runs.
SEED_HASH = hashlib.sha256(b"kvsplice.hash_chain.seed.v1").digest()


def encode_key(key: object) -> bytes:
    """A canonical byte encoding of an extra key (tagged, length-prefixed).

    Unlike pickle (vLLM's default serialiser), equal values always encode alike: pickle's memo
    makes a tuple holding the same str object twice differ from one holding two equal copies.
    Only None, bool, int, str, bytes and tuples of these are accepted.
    """
    if key is None:
        return b"N"
    if isinstance(key, bool):
        return b"T" if key else b"F"
    if isinstance(key, int):
        raw = key.to_bytes((key.bit_length() + 8) // 8, "little", signed=True)
        return b"I" + len(raw).to_bytes(4, "little") + raw
    if isinstance(key, str):
        raw = key.encode("utf-8")
        return b"S" + len(raw).to_bytes(4, "little") + raw
    if isinstance(key, bytes):
        return b"B" + len(key).to_bytes(4, "little") + key
    if isinstance(key, tuple):
        return b"(" + len(key).to_bytes(4, "little") + b"".join(encode_key(k) for k in key)
    raise TypeError(
        f"a prefix-cache namespace must be built from None, bool, int, str, bytes and tuples; "
        f"got {type(key).__name__}"
    )


class BlockHasher:
    """SHA-256 over (parent hash, the block's token ids as little-endian int64, encoded extra keys)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._tokens = struct.Struct(f"<{block_size}q")

    def __call__(self, parent: bytes, token_ids: list[int], extra: bytes) -> bytes:
        # struct.pack raises if token_ids is not exactly one full block.
        return hashlib.sha256(parent + self._tokens.pack(*token_ids) + extra).digest()


# vLLM passes extra_keys=None for blocks without any; the encoding of None stands for that.
_NO_EXTRA_KEYS = encode_key(None)


def first_block_extra_keys(namespace: Hashable) -> bytes:
    """The namespace (model, cache salt) goes into the first block only, as vLLM's cache_salt does:
    every later hash depends on it through the chain."""
    return encode_key((namespace,))


@dataclass(slots=True)
class _RequestBlocks:
    """What the cache remembers of a running request."""

    namespace_key: bytes
    # hashes[j] is the hash of the request's block j; extended as blocks fill up.
    hashes: list[bytes] = field(default_factory=list)
    # Blocks 0 .. num_cached-1 are in the cache's map (hit at admission or registered since).
    num_cached: int = 0


class HashChainCache(PrefixCache):
    name = "hash"

    def __init__(self, allocator: BlockAllocator) -> None:
        super().__init__(allocator)
        self._hasher = BlockHasher(self.block_size)
        # Insertion-ordered per hash: a lookup takes the first registered duplicate, as vLLM does.
        self._blocks_by_hash: dict[bytes, dict[int, None]] = {}
        self._hash_of_block: dict[int, bytes] = {}
        self._requests: dict[str, _RequestBlocks] = {}

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is indexed (held by requests or free but not yet handed out again)."""
        return len(self._hash_of_block)

    @property
    def num_cached_tokens(self) -> int:
        return self.num_cached_blocks * self.block_size

    def acquire(self, seq: CacheSeq) -> PrefixHit:
        """Walk the chain from the first block and stop at the first miss; only blocks that end
        before the last prompt token can hit, so N tokens hit at most floor((N-1)/B)·B."""
        assert seq.num_computed == 0 and not seq.block_table, "acquire takes a fresh request"
        assert seq.request_id not in self._requests, f"request {seq.request_id!r} acquired twice"
        state = _RequestBlocks(first_block_extra_keys(seq.namespace))
        self._requests[seq.request_id] = state
        num_tokens = len(seq.keys)
        max_blocks = max(num_tokens - 1, 0) // self.block_size
        hit: list[int] = []
        for j in range(max_blocks):
            block_hash = self._block_hash(state, seq.keys, j)
            blocks = self._blocks_by_hash.get(block_hash)
            if blocks is None:
                break
            hit.append(next(iter(blocks)))
        # A hit block that sits free in the queue is taken out of it here (vLLM's touch).
        self.allocator.incref(hit)
        state.num_cached = len(hit)
        num_hit_tokens = len(hit) * self.block_size
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens
        return PrefixHit(num_hit_tokens, tuple(hit))

    def peek(self, namespace: Hashable, token_ids: list[int]) -> int:
        """`acquire`'s hit length, hashed on a throwaway chain; the cache is left as it was."""
        state = _RequestBlocks(first_block_extra_keys(namespace))
        j, max_blocks = 0, max(len(token_ids) - 1, 0) // self.block_size
        while j < max_blocks and self._block_hash(state, token_ids, j) in self._blocks_by_hash:
            j += 1
        return j * self.block_size

    def borrow(self, namespace: Hashable, token_ids: list[int]) -> PrefixHit:
        """The chain's blocks as far as they are cached, each referenced for the caller."""
        state = _RequestBlocks(first_block_extra_keys(namespace))
        hit: list[int] = []
        for j in range(len(token_ids) // self.block_size):
            blocks = self._blocks_by_hash.get(self._block_hash(state, token_ids, j))
            if blocks is None:
                break
            hit.append(next(iter(blocks)))
        self.allocator.incref(hit)
        return PrefixHit(len(hit) * self.block_size, tuple(hit))

    def on_computed(self, seq: CacheSeq) -> None:
        """Register every block that became full: prompt blocks after prefill, then one block each
        time decoding fills one."""
        state = self._requests[seq.request_id]
        num_full = seq.num_computed // self.block_size
        assert len(seq.block_table) >= num_full, (
            f"request {seq.request_id!r} has {seq.num_computed} tokens in {len(seq.block_table)} blocks"
        )
        for j in range(state.num_cached, num_full):
            block = seq.block_table[j]
            block_hash = self._block_hash(state, seq.keys, j)
            # The allocator ran the eviction hook when it handed this block to the request.
            assert block not in self._hash_of_block, f"block {block} registered while it is still cached"
            self._hash_of_block[block] = block_hash
            # A duplicate (same prefix computed concurrently by another request) joins the same entry.
            self._blocks_by_hash.setdefault(block_hash, {})[block] = None
            self.allocator.set_evict_hook(block, self._evict)
        if self.listener is not None and num_full > state.num_cached:
            first = state.num_cached
            self.listener.blocks_stored(seq.namespace, seq.keys, first, seq.block_table[first:num_full])
        state.num_cached = max(state.num_cached, num_full)

    def release(self, seq: CacheSeq) -> None:
        """Decref tail first: blocks reaching zero join the free queue in that order, so the end of a
        chain (least likely to be shared) is evicted before its head. Their hashes stay indexed."""
        del self._requests[seq.request_id]
        self.allocator.decref(reversed(seq.block_table))

    def _block_hash(self, state: _RequestBlocks, token_ids: list[int], j: int) -> bytes:
        """Hash of block j, extending the request's chain as far as needed (blocks hash lazily:
        vLLM hashes all full blocks at arrival, but a lookup stops at the first miss anyway)."""
        hashes, hasher, size = state.hashes, self._hasher, self.block_size
        while len(hashes) <= j:
            i = len(hashes)
            if i == 0:
                hashes.append(hasher(SEED_HASH, token_ids[:size], state.namespace_key))
            else:
                hashes.append(hasher(hashes[-1], token_ids[i * size : (i + 1) * size], _NO_EXTRA_KEYS))
        return hashes[j]

    def _evict(self, block: int) -> None:
        # Eviction hook: the allocator is handing this free block out again; its content is lost.
        block_hash = self._hash_of_block.pop(block)
        blocks = self._blocks_by_hash[block_hash]
        del blocks[block]
        if not blocks:
            del self._blocks_by_hash[block_hash]
        if self.listener is not None:
            self.listener.blocks_removed([block])

    def check_invariants(self) -> None:
        """The two maps mirror each other and every running request's chain is consistent (tests)."""
        num_entries = 0
        for block_hash, blocks in self._blocks_by_hash.items():
            assert blocks, "empty hash entry"
            for block in blocks:
                assert self._hash_of_block[block] == block_hash
            num_entries += len(blocks)
        assert num_entries == len(self._hash_of_block)
        for state in self._requests.values():
            assert state.num_cached <= len(state.hashes)
