"""The segment store: KV of segments computed on their own, found again by content wherever they recur.

Every segment is computed after one fixed canonical context, so its KV never depends on the prompt
it first came in. The context is chosen to look like what precedes a document deep inside a long
prompt: the BOS token, then a few generic documents, longer than the model's sliding window. Two
things make this matter. Models like Gemma park huge attention weights on the first token of a
sequence (the attention sink); a segment computed from position 0 would make its own first token a
sink and carry that distortion into every prompt it is spliced into. And on sliding-window layers a
token far into a prompt cannot see BOS at all; a segment computed right after BOS would learn to
lean on a sink that, spliced deep into a prompt, is out of its reach (docs/design.md).

The context's KV is computed once and held by the store; its length is a multiple of the block
size, so each segment's tokens start on a block of their own and an entry holds only them. Entries
live in the shared KV pool under the same budget as the prefix cache: the store holds one reference
per block, and is a `Reclaimer` the allocator asks to drop least recently used entries when memory
runs short. Keys are (namespace, token ids): tenants with different salts share nothing (the
canonical context is public text, shared by all).

An entry's lead KV (its KV at a prompt's start, reuse/segment_kv.LEAD_KV) is a second copy, on a
clock of its own that every use of the entry moves, as well as every prompt spliced from it: a
segment reused anywhere may open the next prompt (in a RAG workload a document opens about one in as
many prompts as they have documents). A lead KV that aged only by those openings went before the
whole prompts the prefix cache keeps of one-off requests, and requests found their first document in
neither; moved by every use, none was dropped (docs/design.md). When memory runs short the least
recently used of all entries and all lead KVs goes first; a lookup touches the lead KV just before
its entry, so of the two it goes first, and evicting an entry drops its lead KV with it.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from importlib import resources
from typing import Protocol

from kvsplice.kv.allocator import BlockAllocator
from kvsplice.model_config import ModelConfig
from kvsplice.prompt import Encoder, bos_ids


@dataclass
class SegmentEntry:
    key: tuple[Hashable, tuple[int, ...]]
    # The segment's own blocks: token j at slot j % block_size of blocks[j // block_size], computed at
    # canonical position len(context) + j.
    blocks: list[int]
    last_access: float = field(default_factory=time.monotonic)
    # How many contexts the stored KV is the mean over (reuse/segment_kv.CONTEXTS).
    contexts: int = 1
    # The segment computed right after a prompt's head alone, as where a prompt starts with it
    # (reuse/segment_kv.LEAD_KV): token j at slot len(lead_head) + j of these blocks, at that
    # position (the head's own KV is in the slots before). None until computed.
    lead_blocks: list[int] | None = None
    lead_head: tuple[int, ...] = ()
    # When a prompt was last spliced from the lead KV (or, before any, when it was attached).
    lead_access: float = 0.0

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
    # Tokens computed to give stored segments more contexts (background work, segment_kv.ContextSample).
    sampled_tokens: int = 0
    # Tokens computed for stored segments' lead KV (segment_kv.LeadFill), and spliced from it.
    lead_tokens: int = 0
    lead_hit_tokens: int = 0
    # Lead KVs dropped for memory while their entry stayed.
    lead_evictions: int = 0


class StoreWatcher(Protocol):
    """Told of every entry that comes and goes (the span finder indexes what the store holds)."""

    def inserted(self, namespace: Hashable, tokens: tuple[int, ...]) -> None: ...

    def evicted(self, namespace: Hashable, tokens: tuple[int, ...]) -> None: ...


class SegmentStore:
    def __init__(self, allocator: BlockAllocator, context: tuple[int, ...]) -> None:
        """context: the canonical context every segment is computed after, a whole number of blocks."""
        assert len(context) % allocator.block_size == 0, "the canonical context must fill whole blocks"
        self.allocator = allocator
        self.context = context
        # The context's KV, computed once by the engine and held here for good (None until then).
        self.context_blocks: list[int] | None = None
        self._entries: dict[tuple[Hashable, tuple[int, ...]], SegmentEntry] = {}
        # (last access, tie-break, key, lead) candidates for eviction: an entry, or (lead) only its lead
        # KV; stale ones are skipped when popped.
        self._lru: list[tuple[float, int, tuple[Hashable, tuple[int, ...]], bool]] = []
        self._counter = 0
        self.stats = SegmentStoreStats()
        self._watchers: list[StoreWatcher] = []
        allocator.add_reclaimer(self)

    def __len__(self) -> int:
        return len(self._entries)

    def watch(self, watcher: StoreWatcher) -> None:
        self._watchers.append(watcher)

    def unwatch(self, watcher: StoreWatcher) -> None:
        assert watcher in self._watchers, "unwatching a watcher the store does not have"
        self._watchers.remove(watcher)

    @property
    def start_position(self) -> int:
        """The position of a segment's first token in its canonical sequence."""
        return len(self.context)

    def contains(self, namespace: Hashable, tokens: tuple[int, ...]) -> bool:
        """Whether the store holds these tokens; changes nothing (no stats, no access time)."""
        return (namespace, tokens) in self._entries

    def peek(self, namespace: Hashable, tokens: tuple[int, ...]) -> SegmentEntry | None:
        """The stored entry, if any; changes nothing. Valid until the next allocation."""
        return self._entries.get((namespace, tokens))

    def lookup(self, namespace: Hashable, tokens: tuple[int, ...]) -> SegmentEntry | None:
        """The stored entry for these tokens, refreshed as most recently used.

        Valid until the next allocation, which may evict it."""
        self.stats.lookups += 1
        entry = self._entries.get((namespace, tokens))
        if entry is not None:
            self.stats.hits += 1
            self.stats.hit_tokens += len(tokens)
            if entry.lead_blocks is not None:
                self._touch_lead(entry)
            self._touch(entry)
        return entry

    def others(self, namespace: Hashable, tokens: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The other segments held for `namespace`, oldest first; changes nothing."""
        return [t for (ns, t) in self._entries if ns == namespace and t != tokens]

    def count_queued_hit(self, tokens: tuple[int, ...]) -> None:
        """A lookup that missed, served instead by a segment whose copy into the store is queued (its KV
        moved from the request that computed it): a hit for the counters, as it will be once copied."""
        assert self.stats.lookups > self.stats.hits, "a queued hit follows a lookup that missed"
        self.stats.hits += 1
        self.stats.hit_tokens += len(tokens)

    def insert(self, namespace: Hashable, tokens: tuple[int, ...], blocks: list[int]) -> None:
        """Keep the canonical sequence in `blocks`; the store takes over the caller's reference on each."""
        key = (namespace, tokens)
        assert key not in self._entries, "segment inserted twice"
        needed = -(-len(tokens) // self.allocator.block_size)
        assert len(blocks) == needed, f"{len(blocks)} blocks for {needed}"
        entry = SegmentEntry(key, blocks)
        self._entries[key] = entry
        self.stats.inserted_tokens += len(tokens)
        self._touch(entry)
        for watcher in self._watchers:
            watcher.inserted(namespace, tokens)

    def attach_lead(self, entry: SegmentEntry, blocks: list[int], head: tuple[int, ...]) -> None:
        """Give a held entry its lead KV (segment_kv.LeadFill); the store takes over the references."""
        assert self._entries.get(entry.key) is entry, "lead KV for an entry the store does not hold"
        assert entry.lead_blocks is None, "lead KV attached twice"
        entry.lead_blocks, entry.lead_head = blocks, head
        self._touch_lead(entry)

    def lead_hit(self, entry: SegmentEntry) -> None:
        """A prompt is spliced from the entry's lead KV: it is used, so it is kept longer."""
        assert entry.lead_blocks is not None, "a lead hit on an entry without lead KV"
        self.stats.lead_hit_tokens += entry.num_tokens
        self._touch_lead(entry)

    def oldest_access(self) -> float | None:
        while self._lru:
            access, _, key, lead = self._lru[0]
            entry = self._entries.get(key)
            if entry is not None and (
                entry.lead_access == access and entry.lead_blocks is not None
                if lead
                else entry.last_access == access
            ):
                return access
            heapq.heappop(self._lru)
        return None

    def reclaim_one(self) -> None:
        assert self.oldest_access() is not None, "nothing to reclaim"
        _, _, key, lead = heapq.heappop(self._lru)
        if lead:
            entry = self._entries[key]
            assert entry.lead_blocks is not None
            self.allocator.decref(reversed(entry.lead_blocks))
            entry.lead_blocks, entry.lead_head = None, ()
            self.stats.lead_evictions += 1
            return
        entry = self._entries.pop(key)
        self.stats.evictions += 1
        self.allocator.decref(reversed(entry.blocks))
        if entry.lead_blocks is not None:
            self.allocator.decref(reversed(entry.lead_blocks))
        for watcher in self._watchers:
            watcher.evicted(*key)

    def clear(self) -> None:
        while self.oldest_access() is not None:
            self.reclaim_one()

    def _touch(self, entry: SegmentEntry) -> None:
        entry.last_access = time.monotonic()
        self._counter += 1
        heapq.heappush(self._lru, (entry.last_access, self._counter, entry.key, False))

    def _touch_lead(self, entry: SegmentEntry) -> None:
        entry.lead_access = time.monotonic()
        self._counter += 1
        heapq.heappush(self._lru, (entry.lead_access, self._counter, entry.key, True))


# A stored segment is computed after this many tokens of context by default (more where a sliding
# window needs a full window of context): about where a segment sits in a prompt of several documents
# (docs/design.md says why 1,024).
CONTEXT_TOKENS = 1024


def canonical_context_length(cfg: ModelConfig, block_size: int) -> int:
    """Tokens of the canonical context: CONTEXT_TOKENS (the model's sliding window plus 64 where that
    is more; at most half the model's positions), rounded up to whole blocks."""
    window = cfg.sliding_window + 64 if cfg.sliding_window else 0
    tokens = min(max(CONTEXT_TOKENS, window), cfg.max_position_embeddings // 2)
    return -(-tokens // block_size) * block_size


def canonical_context(tokenizer: Encoder | None, cfg: ModelConfig, block_size: int) -> tuple[int, ...]:
    """The context every stored segment is computed after: BOS (when the model expects one), then
    generic documents, `canonical_context_length` tokens. Empty for a model without a tokenizer."""
    if tokenizer is None:
        return ()
    length = canonical_context_length(cfg, block_size)
    text = (resources.files("kvsplice") / "data" / "segment_context.txt").read_text()
    filler = tokenizer.encode(text)
    tokens = bos_ids(tokenizer) + filler * (1 + length // len(filler))
    return tuple(tokens[:length])
