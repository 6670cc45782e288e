"""The prefix-cache interface the engine talks to, and the registry that picks one by name.

A prefix cache maps the leading tokens of a request to KV blocks that already hold them. It is
plain Python over a `BlockAllocator`: it never touches tensors. The engine calls, per request:

    hit = cache.acquire(seq)      # at admission: take the longest usable cached prefix
    ...                           # the engine writes KV for tokens hit.num_tokens.. into seq.block_table
    cache.on_computed(seq)        # whenever seq.num_computed grew (after prefill, after each decode step)
    cache.release(seq)            # finished or aborted: drop the request's references, keep what is cacheable
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from kvsplice.kv.allocator import BlockAllocator


@dataclass
class CacheSeq:
    """What a prefix cache sees of one request. The engine owns and mutates it."""

    request_id: str
    # Requests in different namespaces (model, cache salt) never share KV.
    namespace: Hashable
    # The ids the cache indexes, one per token: the prompt's token ids (or, under splicing, its segment
    # keys: cache/segment_keys.py), then the generated tokens.
    keys: list[int]
    # Block ids; token i's KV lives in block_table[i // block_size] at slot i % block_size.
    block_table: list[int] = field(default_factory=list)
    # Tokens 0 .. num_computed-1 have their KV written (the last sampled token never has).
    num_computed: int = 0


@dataclass(frozen=True)
class PrefixHit:
    """The cached prefix a request takes at admission.

    `blocks` cover tokens 0 .. num_tokens-1 and the request holds one reference on each. When
    num_tokens is not a multiple of the block size, the last block is shared and only partly
    valid for this request: the engine copies its first num_tokens % block_size slots into a
    fresh block before writing, then drops its reference on the shared one.
    """

    num_tokens: int
    blocks: tuple[int, ...]


@dataclass
class PrefixCacheStats:
    """Counted in tokens, once per request at admission (vLLM's prefix_cache_queries / _hits)."""

    queries: int = 0
    hits: int = 0


class BlockListener(Protocol):
    """Told when full blocks start or stop being cached (KV events for routers: store/recorder.py)."""

    def blocks_stored(
        self, namespace: Hashable, keys: Sequence[int], first: int, blocks: Sequence[int]
    ) -> None:
        """Blocks first .. first + len(blocks) - 1 of the path `keys` are now cached, whole; blocks[i]
        holds block first + i, and `keys` runs at least to the end of the last one."""

    def blocks_removed(self, blocks: Sequence[int]) -> None:
        """These blocks, each reported stored before, are cached no more."""


class PrefixCache(ABC):
    name: ClassVar[str]

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.stats = PrefixCacheStats()
        self.listener: BlockListener | None = None

    @property
    @abstractmethod
    def num_cached_tokens(self) -> int:
        """Tokens whose KV the cache indexes now."""

    @abstractmethod
    def acquire(self, seq: CacheSeq) -> PrefixHit:
        """Match seq.keys (the prompt; seq.num_computed == 0 and seq.block_table is empty) and take
        the hit for the request. At most len(keys) - 1 tokens hit: the last prompt token is always
        computed, its logits are needed. Updates `stats`."""

    @abstractmethod
    def peek(self, namespace: Hashable, token_ids: list[int]) -> int:
        """How many tokens `acquire` would hit for these tokens now; changes nothing (no stats, no
        access times, no splits)."""

    @abstractmethod
    def borrow(self, namespace: Hashable, token_ids: list[int]) -> PrefixHit:
        """The blocks of the longest cached prefix of token_ids (every token may hit), to read KV from
        (the span finder moves an earlier prompt's KV): one reference taken on each for the caller,
        who drops them with allocator.decref. No stats, no locks, no splits: a referenced block is
        never handed out again, so its KV stays valid while held even if the cache lets go of it."""

    @abstractmethod
    def on_computed(self, seq: CacheSeq) -> None:
        """seq.num_computed grew: the cache may index the newly completed blocks."""

    @abstractmethod
    def release(self, seq: CacheSeq) -> None:
        """The request is done: drop its reference on every block of seq.block_table, in the cache's
        order, and keep whatever the cache keeps. seq is not used again."""


class NoPrefixCache(PrefixCache):
    """Caching off: nothing is ever hit; a finished request frees its blocks."""

    name = "off"

    @property
    def num_cached_tokens(self) -> int:
        return 0

    def acquire(self, seq: CacheSeq) -> PrefixHit:
        self.stats.queries += len(seq.keys)
        return PrefixHit(0, ())

    def peek(self, namespace: Hashable, token_ids: list[int]) -> int:
        return 0

    def borrow(self, namespace: Hashable, token_ids: list[int]) -> PrefixHit:
        return PrefixHit(0, ())

    def on_computed(self, seq: CacheSeq) -> None:
        pass

    def release(self, seq: CacheSeq) -> None:
        self.allocator.decref(reversed(seq.block_table))
