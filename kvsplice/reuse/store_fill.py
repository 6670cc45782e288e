"""Filling the segment store with the segments a request missed, in one of two ways:

- `capture_in_place`: the KV the request itself computed for the segment (exact in that request's
  context) is copied into blocks of the store's own, keys rotated to the canonical positions. No
  token is computed twice: a new document costs one prefill, as with a prefix cache.
- `StoreFill`: the segment is computed again on its own, after the canonical context.

A fill is background work: the scheduler runs it only in token budget no request needs, and it is
dropped (never waited for) when the pool has no memory to spare. The first fill also computes the
canonical context, in the same pass, and hands its blocks to the store for good.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from kvsplice.cache.segments import SegmentStore
from kvsplice.errors import OutOfBlocksError
from kvsplice.kv.pool import KVPool
from kvsplice.model_config import ModelConfig
from kvsplice.reuse.place import move_kv
from kvsplice.reuse.work import Pass, PrefillWork


class StoreFill:
    def __init__(
        self, store: SegmentStore, pool: KVPool, num_layers: int, namespace: Hashable, tokens: tuple[int, ...]
    ) -> None:
        self.store = store
        self.pool = pool
        self.num_layers = num_layers
        self.namespace = namespace
        self.tokens = tokens
        self._blocks: list[int] = []
        self._with_context = False

    def start(self) -> PrefillWork | None:
        """Reserve the fill's blocks and return its work; None when the store already holds the
        segment or memory is short (the fill is dropped)."""
        if self.store.contains(self.namespace, self.tokens):
            return None
        bs, context = self.pool.block_size, self.store.context
        self._with_context = self.store.context_blocks is None
        own = -(-len(self.tokens) // bs) + (len(context) // bs if self._with_context else 0)
        try:
            self._blocks = self.pool.allocator.allocate(own)
        except OutOfBlocksError:
            return None
        table = self._blocks if self._with_context else self.store.context_blocks + self._blocks  # type: ignore[operator]
        start = 0 if self._with_context else len(context)
        positions = tuple(range(start, len(context) + len(self.tokens)))
        return PrefillWork(
            table,
            context + self.tokens,
            Pass(positions, range(self.num_layers)),
            self.num_layers,
            need_logits=False,
        )

    def finish(self) -> None:
        """The work is done: the store takes the blocks (and the context's, on the first fill)."""
        blocks = self._blocks
        if self._with_context:
            split = len(self.store.context) // self.pool.block_size
            self.store.context_blocks, blocks = blocks[:split], blocks[split:]
        self.store.insert(self.namespace, self.tokens, blocks)


def capture_in_place(
    store: SegmentStore,
    pool: KVPool,
    cfg: ModelConfig,
    freqs: dict[str, torch.Tensor],
    namespace: Hashable,
    tokens: tuple[int, ...],
    block_table: Sequence[int],
    start: int,
) -> bool:
    """Keep the KV a request computed for `tokens` at positions start.. of `block_table`, moved to the
    canonical positions. False (nothing kept) when the store already holds them or memory is short."""
    if store.contains(namespace, tokens):
        return False
    try:
        blocks = pool.allocator.allocate(-(-len(tokens) // pool.block_size))
    except OutOfBlocksError:
        return False
    local = torch.arange(len(tokens), device=pool.device)
    src = pool.slots(list(block_table), local + start)
    dst = pool.slots(blocks, local)
    move_kv(pool, cfg, freqs, src, dst, torch.full_like(local, store.start_position - start))
    store.insert(namespace, tokens, blocks)
    return True
