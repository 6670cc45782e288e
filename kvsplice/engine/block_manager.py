"""Admission and memory: a request's cached prefix and its blocks, from admission to release.

Blocks for the prompt and every token the request may generate are reserved at admission, so a
running request never runs out of KV memory mid-prefill or mid-decode (there is no preemption): a
request that does not fit waits, at the head of the queue, until finished requests free memory.
"""

from __future__ import annotations

import torch

from kvsplice.cache.base import PrefixCache
from kvsplice.cache.segment_keys import SegmentKeys
from kvsplice.engine.request import Admission, Request
from kvsplice.errors import OutOfBlocksError
from kvsplice.kv.pool import KVPool
from kvsplice.repair.registry import POLICIES


class BlockManager:
    def __init__(
        self,
        pool: KVPool,
        prefix_cache: PrefixCache,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.pool = pool
        self.allocator = pool.allocator
        self.prefix_cache = prefix_cache
        self.max_model_len = max_model_len
        self.segment_keys = SegmentKeys(vocab_size)

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        total = min(num_prompt_tokens + max_tokens, self.max_model_len)
        return -(-total // self.pool.block_size)

    def fits_empty_pool(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        # One block to spare: admission copies a partial prefix hit into a fresh block while it still
        # holds the shared one, so a request that needs every block never fits. (Copying more of the
        # hit is skipped where memory is short.)
        return self.blocks_needed(num_prompt_tokens, max_tokens) + 1 <= self.pool.num_blocks

    def plain_hit(self, request: Request) -> int:
        """The prefix the cache holds for the request's plain token ids (changes nothing)."""
        return self.prefix_cache.peek(request.seq.namespace, list(request.prompt.token_ids))

    def admit(self, request: Request, first_found: int | None, exact_lead: int | None) -> Admission | None:
        """Take the request's cached prefix and reserve its blocks; None, holding nothing, if memory is
        short. `first_found`, `exact_lead`: what the reuse path found for it (reuse/path.Lookup), by
        which its keys are chosen (cache/segment_keys.py)."""
        seq = request.seq
        approximate = not POLICIES[request.repair.policy].exact
        keys = self.segment_keys.choose(
            request.prompt,
            request.repair,
            approximate,
            lambda ids: self.prefix_cache.peek(seq.namespace, ids),
            first_found,
            exact_lead,
        )
        seq.keys = keys.ids
        hit = self.prefix_cache.acquire(seq)
        table = list(hit.blocks)
        bs = self.pool.block_size
        needed = self.blocks_needed(request.num_prompt_tokens, request.params.max_tokens)
        # The hit blocks to copy into the request's own: the last one where the hit ends inside it (it is
        # shared and only partly ours), and, where the hit holds an earlier request's spliced KV (past
        # where the segment keys start), every block from there on, so that repair may recompute it
        # (copy on write). Copying those takes memory: without it to spare they stay shared, approximate.
        partial_from = own_from = len(table) - (1 if hit.num_tokens % bs else 0)
        if keys.approximate_from is not None and hit.num_tokens > keys.approximate_from:
            own_from = min(own_from, keys.approximate_from // bs)
        fresh = self._allocate(needed - own_from)
        if fresh is None and own_from < partial_from:
            own_from = partial_from
            fresh = self._allocate(needed - own_from)
        if fresh is None:
            seq.block_table = table
            self.prefix_cache.release(seq)
            seq.block_table = []
            return None
        if own_from < len(table):
            copies = fresh[: len(table) - own_from]
            # The hit's valid slots from block own_from on: positions p -> slot (block of p) * bs + p % bs.
            positions = torch.arange(own_from * bs, hit.num_tokens, device=self.pool.device)
            shared = self.pool.slots(table[own_from:], positions - own_from * bs)
            self.pool.copy_slots(shared, self.pool.slots(copies, positions - own_from * bs))
            self.allocator.decref(table[own_from:])
            table[own_from:] = copies
            fresh = fresh[len(copies) :]
        seq.block_table = table + fresh
        return Admission(hit.num_tokens, keys.approximate_from, own_from * bs)

    def _allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, or None if memory is short."""
        try:
            return self.allocator.allocate(n)
        except OutOfBlocksError:
            return None

    def computed(self, request: Request) -> None:
        """The request's written KV grew (its prefill finished, or a decode step ran)."""
        request.seq.num_computed = request.indexable_len
        self.prefix_cache.on_computed(request.seq)

    def free(self, request: Request) -> None:
        """The request is done: its blocks go back to the prefix cache, which keeps what it caches."""
        if request.seq.block_table:
            self.prefix_cache.release(request.seq)
            request.seq.block_table = []
