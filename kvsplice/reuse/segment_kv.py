"""Filling the segment store with the segments a request missed.

`capture_in_place`: the KV the request itself computed for the segment (exact in that request's
context) is copied into blocks of the store's own, keys rotated to the canonical positions. No token
is computed twice: a new document costs one prefill, as with a prefix cache.

The stored KV saw one context, and a spliced segment is wrong by how its new context differs
from that one. With `CONTEXTS` = n > 1 the store then computes the segment after
n - 1 more contexts made of other segments it holds (`ContextSample`), and keeps the mean KV over all
n: the mean is nearer to the KV of an unseen context than any one sample (the part of the KV that
depends on which context preceded averages out), which is what repair starts from.

A fill is background work: the scheduler runs it only in token budget no request needs, and it is
dropped (never waited for) when the pool has no memory to spare. The canonical context's KV is
computed once and held by the store for good, by a `CanonicalContextFill` before the first context
sample, whose canonical text is then moved from it.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvsplice.cache.segments import SegmentStore
from kvsplice.errors import OutOfBlocksError
from kvsplice.kv.pool import KVPool
from kvsplice.model_config import ModelConfig
from kvsplice.reuse.place import move_kv
from kvsplice.reuse.work import Pass, PrefillWork

# Contexts a stored segment's KV is the mean over (1: the one it was stored with); docs/design.md says
# why 4.
CONTEXTS = 4
# Whether a stored segment also keeps its KV computed at a prompt's start (`LeadFill`).
LEAD_KV = True


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


def capture_lead_in_place(
    store: SegmentStore,
    pool: KVPool,
    namespace: Hashable,
    tokens: tuple[int, ...],
    head: tuple[int, ...],
    block_table: Sequence[int],
) -> bool:
    """Give a stored segment the lead KV a request computed for it: the request opened with `head`, then
    the segment, all exact, so positions 0.. of `block_table` hold what `LeadFill` would compute (the
    head's KV, then the segment's after it). Copied, not computed. False when the entry is gone or has
    lead KV, or memory is short."""
    entry = store.peek(namespace, tokens)
    if entry is None or entry.lead_blocks is not None:
        return False
    n = len(head) + len(tokens)
    try:
        blocks = pool.allocator.allocate(-(-n // pool.block_size))
    except OutOfBlocksError:
        return False
    # The allocation may have evicted the entry it was for.
    if store.peek(namespace, tokens) is not entry:
        pool.allocator.decref(reversed(blocks))
        return False
    local = torch.arange(n, device=pool.device)
    pool.copy_slots(pool.slots(list(block_table), local), pool.slots(blocks, local))
    store.attach_lead(entry, blocks, head)
    return True


def _whole_sequence(
    pool: KVPool, sequence: tuple[int, ...], num_layers: int
) -> tuple[list[int], PrefillWork] | None:
    """Fresh blocks for `sequence` and the work that computes all of it from position 0 through every
    layer; None when memory is short."""
    try:
        blocks = pool.allocator.allocate(-(-len(sequence) // pool.block_size))
    except OutOfBlocksError:
        return None
    positions = tuple(range(len(sequence)))
    return blocks, PrefillWork(
        blocks, sequence, Pass(positions, range(num_layers)), num_layers, need_logits=False
    )


class CanonicalContextFill:
    """The canonical context's KV, computed once and held by the store for good. A context sample
    starts with the canonical context's first tokens (all of them while the store holds few other
    segments), at their own positions: their KV is then moved from here instead of computed, about
    1,000 tokens a sample on a store that holds a few short documents."""

    def __init__(self, store: SegmentStore, pool: KVPool, num_layers: int) -> None:
        self.store = store
        self.pool = pool
        self.num_layers = num_layers
        self._blocks: list[int] = []

    def start(self) -> PrefillWork | None:
        """Reserve the context's blocks and return its work; None when the store holds it already or
        memory is short (the samples then compute their canonical text)."""
        if self.store.context_blocks is not None:
            return None
        whole = _whole_sequence(self.pool, self.store.context, self.num_layers)
        if whole is None:
            return None
        self._blocks, work = whole
        self.store.stats.sampled_tokens += len(self.store.context)
        return work

    def finish(self) -> None:
        assert self.store.context_blocks is None, "the canonical context's KV is computed once"
        self.store.context_blocks = self._blocks


class LeadFill:
    """A stored segment's lead KV (SegmentEntry.lead_blocks): the segment computed right after `head`,
    the head of the prompt that carried it (BOS and an instruction line, at most
    prefill.LEAD_HEAD_TOKENS; BOS alone where it had none). Where a prompt starts with the segment after
    the same head, that is the KV a full prefill computes there, and after another short head it is
    nearly so, while the stored KV was computed after a long context; on the recall evaluation the
    first document is where the stored KV is furthest from a full prefill's. Background work like
    a context sample."""

    def __init__(
        self,
        store: SegmentStore,
        pool: KVPool,
        num_layers: int,
        namespace: Hashable,
        tokens: tuple[int, ...],
        head: tuple[int, ...],
    ) -> None:
        self.store = store
        self.pool = pool
        self.num_layers = num_layers
        self.namespace = namespace
        self.tokens = tokens
        self.head = head
        self._blocks: list[int] = []

    def start(self) -> PrefillWork | None:
        """Reserve the blocks and return the work; None when the entry is gone or has its lead KV, the
        store has no context (a model without a tokenizer), or memory is short."""
        entry = self.store.peek(self.namespace, self.tokens)
        if entry is None or entry.lead_blocks is not None or not self.store.context:
            return None
        sequence = self.head + self.tokens
        whole = _whole_sequence(self.pool, sequence, self.num_layers)
        if whole is None:
            return None
        self._blocks, work = whole
        self.store.stats.lead_tokens += len(sequence)
        return work

    def finish(self) -> None:
        """The entry takes the blocks, if it is still held; else they go back."""
        entry = self.store.peek(self.namespace, self.tokens)
        if entry is not None and entry.lead_blocks is None:
            self.store.attach_lead(entry, self._blocks, self.head)
        else:
            self.pool.allocator.decref(reversed(self._blocks))
        self._blocks = []


@dataclass(frozen=True)
class ContextPiece:
    """A stretch of a sampled context: `tokens`, the end of the stored segment `source` from token
    `offset` on (its KV is moved from the store, not computed); with `canonical`, the canonical
    context's first tokens at their own positions (moved from the store's canonical KV where it holds
    it); else computed."""

    tokens: tuple[int, ...]
    source: tuple[int, ...] | None = None
    offset: int = 0
    canonical: bool = False


class ContextSample:
    """The `index`-th extra context of a stored segment: the segment computed after other segments the
    store holds, folded into the entry's running mean. Background work.

    The other segments' KV is moved from the store, not computed: only the segment's own tokens (and
    the first token, and canonical text where the others are too few) run through the model. The
    sample is then exact over an approximate context, which is what it is for: a context like the ones
    the segment is reused after. Computing the context too cost three times as much on the recall
    bench (576 context tokens per ~300-token document)."""

    def __init__(
        self,
        store: SegmentStore,
        pool: KVPool,
        cfg: ModelConfig,
        freqs: dict[str, torch.Tensor],
        namespace: Hashable,
        tokens: tuple[int, ...],
        index: int,
    ) -> None:
        assert index >= 1, "context 0 is the one the segment was stored with"
        self.store = store
        self.pool = pool
        self.cfg = cfg
        self.freqs = freqs
        self.namespace = namespace
        self.tokens = tokens
        self.index = index
        self._blocks: list[int] = []

    def start(self) -> PrefillWork | None:
        """Reserve the sample's blocks, move the context's stored pieces into them and return the work
        that computes the rest. None when the entry is gone, the store has no context to vary, or
        memory is short."""
        if self.store.peek(self.namespace, self.tokens) is None:
            return None
        pieces = sample_context(self.store, self.namespace, self.tokens, self.index)
        if not pieces:
            return None
        sequence = tuple(t for piece in pieces for t in piece.tokens) + self.tokens
        try:
            self._blocks = self.pool.allocator.allocate(-(-len(sequence) // self.pool.block_size))
        except OutOfBlocksError:
            return None
        device, start = self.pool.device, self.store.start_position
        src, dst, compute, position = [], [], [], 0
        for piece in pieces:
            here = list(range(position, position + len(piece.tokens)))
            local = torch.arange(len(piece.tokens), device=device) + piece.offset
            # Keys rotate from where the KV was computed (a stored segment at the canonical positions,
            # the canonical context at its own) to `here`.
            if piece.canonical:
                blocks, shift = self.store.context_blocks, 0
            else:
                # Looked up after the allocation, which may have evicted a source: that piece is computed.
                entry = self.store.peek(self.namespace, piece.source) if piece.source is not None else None
                blocks, shift = (entry.blocks if entry else None), start
            if blocks is None:
                compute += here
            else:
                delta = torch.tensor(here, device=device) - local - shift
                src.append((self.pool.slots(blocks, local), delta))
                dst += here
            position += len(piece.tokens)
        if src:
            slots, delta = (torch.cat(parts) for parts in zip(*src, strict=True))
            target = self.pool.slots(self._blocks, torch.tensor(dst, device=device))
            move_kv(self.pool, self.cfg, self.freqs, slots, target, delta)
        compute += range(position, len(sequence))
        self.store.stats.sampled_tokens += len(compute)
        return PrefillWork(
            self._blocks,
            sequence,
            Pass(tuple(compute), range(self.cfg.num_layers)),
            self.cfg.num_layers,
            need_logits=False,
        )

    def finish(self) -> None:
        """Fold the sample into the entry (if it is still held) and give the sample's blocks back."""
        entry = self.store.peek(self.namespace, self.tokens)
        if entry is not None:
            local = torch.arange(len(self.tokens), device=self.pool.device)
            stored = self.pool.slots(entry.blocks, local)
            # The sample's context is as long as the canonical one: the segment sits at its canonical
            # positions, so keys fold without a rotation.
            sampled = self.pool.slots(self._blocks, local + self.store.start_position)
            weight = 1.0 / (entry.contexts + 1)
            for layer in range(self.cfg.num_layers):
                k, v = self.pool.read(layer, stored)
                new_k, new_v = self.pool.read(layer, sampled)
                k, v = k.float(), v.float()
                self.pool.write(
                    layer, stored, k + (new_k.float() - k) * weight, v + (new_v.float() - v) * weight
                )
            entry.contexts += 1
        self.pool.allocator.decref(reversed(self._blocks))
        self._blocks = []


def sample_context(
    store: SegmentStore, namespace: Hashable, tokens: tuple[int, ...], index: int
) -> list[ContextPiece]:
    """A context as long as the canonical one, to compute `tokens` after: the canonical context's first
    tokens (BOS, then as much of its text as the other segments leave room for: a prefix of the
    canonical context, whose KV the store may hold), then the ends of other stored segments of the
    namespace in an order drawn from (index, tokens). Empty when the store has no canonical context (a
    model without a tokenizer: segments start at position 0)."""
    context = store.context
    if not context:
        return []
    others = store.others(namespace, tokens)
    random.Random(hash((index, tokens))).shuffle(others)
    remaining, pieces = len(context) - 1, []
    for other in others:
        if remaining == 0:
            break
        take = min(len(other), remaining)
        pieces.append(ContextPiece(other[len(other) - take :], other, len(other) - take))
        remaining -= take
    pieces.reverse()  # the first drawn ends the context, the last may be cut at its front
    return [ContextPiece(context[: 1 + remaining], canonical=True), *pieces]
