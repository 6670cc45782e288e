"""Reference-counted KV blocks, in plain Python: the bookkeeping half of the KV pool.

A block is a fixed number of token slots in the pool's tensors. Its reference count is the number
of holders: running requests and caches that keep it (the radix tree, the segment store). A block
with no holder sits in the free queue, oldest-released first. A free block may still hold cached
KV (vLLM's prefix cache keeps released blocks that way): its owner registers an eviction hook, and
the hook runs when the block is handed out again, so the content is dropped only when its memory
is needed. Caches that hold references instead register a `Reclaimer`, asked to let go of their
least recently used entries when the free queue runs short.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from kvsplice.errors import OutOfBlocksError


class Reclaimer(Protocol):
    """A cache that holds block references and can release some of them on demand."""

    def oldest_access(self) -> float | None:
        """Last-access time of the entry `reclaim_one` would release next; None if nothing is evictable."""

    def reclaim_one(self) -> None:
        """Release the least recently used evictable entry (its blocks are decref'd)."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        # Insertion order is release order: the head is evicted first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._evict_hooks: dict[int, Callable[[int], None]] = {}
        self._reclaimers: list[Reclaimer] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref(self, block: int) -> int:
        return self._ref[block]

    def is_free(self, block: int) -> bool:
        return block in self._free

    def add_reclaimer(self, reclaimer: Reclaimer) -> None:
        self._reclaimers.append(reclaimer)

    def set_evict_hook(self, block: int, hook: Callable[[int], None] | None) -> None:
        """Run `hook(block)` when this block, once free, is handed out again (its content is lost)."""
        if hook is None:
            self._evict_hooks.pop(block, None)
        else:
            self._evict_hooks[block] = hook

    def allocate(self, n: int) -> list[int]:
        """`n` blocks with reference count 1, evicting cached content as needed."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        self._reclaim(n)
        if len(self._free) < n:
            raise OutOfBlocksError(
                f"the KV pool has {self.num_blocks} blocks of {self.block_size} tokens; {n} more are needed "
                f"but only {len(self._free)} can be freed (the rest are held by running requests)"
            )
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            hook = self._evict_hooks.pop(block, None)
            if hook is not None:
                hook(block)
            assert self._ref[block] == 0, f"free block {block} has ref {self._ref[block]}"
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed, reclaiming cache entries if needed (it may reclaim them)."""
        self._reclaim(n)
        return len(self._free) >= n

    def incref(self, blocks: Iterable[int]) -> None:
        """Add a holder to each block; a free block with cached content is taken back out of the queue."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        """Drop a holder from each block, in the given order; blocks reaching zero join the queue's tail."""
        for block in blocks:
            assert self._ref[block] > 0, f"decref of block {block} with no holder"
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    def _reclaim(self, n: int) -> None:
        while len(self._free) < n:
            candidates = [
                (t, i) for i, r in enumerate(self._reclaimers) if (t := r.oldest_access()) is not None
            ]
            if not candidates:
                return
            _, index = min(candidates)
            self._reclaimers[index].reclaim_one()

    def check_invariants(self) -> None:
        """Every block is either free with no holder or held and not free (used by tests)."""
        for block in range(self.num_blocks):
            assert self._ref[block] >= 0
            assert (self._ref[block] == 0) == (block in self._free), f"block {block} ref {self._ref[block]}"
