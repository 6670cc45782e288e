"""The segment store: KV of segments computed on their own, found again by content wherever they recur.

A segment is computed after a fixed canonical context (the BOS token, when the model has one), so its
KV never depends on the prompt it first came in, and the first segment token is not made the attention
sink: models like Gemma park huge attention weights on the first token of a sequence, and a segment
computed from position 0 would carry that distortion into every prompt it is spliced into.

Entries live in the shared KV pool under the same budget as the prefix cache: the store holds one
reference per block, and is a `Reclaimer` the allocator asks to drop least recently used entries
when memory runs short. Keys are (namespace, token ids): tenants with different salts share nothing.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from kvsplice.kv.allocator import BlockAllocator


@dataclass
class SegmentEntry:
    key: tuple[Hashable, tuple[int, ...]]
    # Blocks of the canonical sequence: canonical context, then the segment's tokens.
    blocks: list[int]
    last_access: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        return len(self.key[1])


@dataclass
class SegmentStoreStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0
    evictions: int = 0


class SegmentStore:
    def __init__(self, allocator: BlockAllocator, context: tuple[int, ...]) -> None:
        """context: the canonical context every segment is computed after."""
        self.allocator = allocator
        self.context = context
        self._entries: dict[tuple[Hashable, tuple[int, ...]], SegmentEntry] = {}
        # (last_access, key) candidates for eviction; stale ones are skipped when popped.
        self._lru: list[tuple[float, int, tuple[Hashable, tuple[int, ...]]]] = []
        self._counter = 0
        self.stats = SegmentStoreStats()
        allocator.add_reclaimer(self)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def start_position(self) -> int:
        """The position of a segment's first token in its canonical sequence."""
        return len(self.context)

    def lookup(self, namespace: Hashable, tokens: tuple[int, ...]) -> SegmentEntry | None:
        """The stored entry for these tokens, refreshed as most recently used.

        Valid until the next allocation, which may evict it."""
        self.stats.lookups += 1
        entry = self._entries.get((namespace, tokens))
        if entry is not None:
            self.stats.hits += 1
            self.stats.hit_tokens += len(tokens)
            self._touch(entry)
        return entry

    def insert(self, namespace: Hashable, tokens: tuple[int, ...], blocks: list[int]) -> None:
        """Keep the canonical sequence in `blocks`; the store takes over the caller's reference on each."""
        key = (namespace, tokens)
        assert key not in self._entries, "segment inserted twice"
        needed = -(-(len(self.context) + len(tokens)) // self.allocator.block_size)
        assert len(blocks) == needed, f"{len(blocks)} blocks for {needed}"
        entry = SegmentEntry(key, blocks)
        self._entries[key] = entry
        self.stats.inserted_tokens += len(tokens)
        self._touch(entry)

    def oldest_access(self) -> float | None:
        while self._lru:
            access, _, key = self._lru[0]
            entry = self._entries.get(key)
            if entry is not None and entry.last_access == access:
                return access
            heapq.heappop(self._lru)
        return None

    def reclaim_one(self) -> None:
        assert self.oldest_access() is not None, "nothing to reclaim"
        _, _, key = heapq.heappop(self._lru)
        entry = self._entries.pop(key)
        self.stats.evictions += 1
        self.allocator.decref(reversed(entry.blocks))

    def clear(self) -> None:
        while self.oldest_access() is not None:
            self.reclaim_one()

    def _touch(self, entry: SegmentEntry) -> None:
        entry.last_access = time.monotonic()
        self._counter += 1
        heapq.heappush(self._lru, (entry.last_access, self._counter, entry.key))
