"""SGLang's RadixAttention prefix cache: a radix tree over token ids, in plain Python.

One tree per namespace (model, cache salt): namespaces never share a node. An edge holds a run of
tokens; a match may end at any token (or page) boundary, capped at the prompt length minus one,
and a match that ends inside an edge splits it. A finished request inserts its computed tokens;
the part already in the tree is a duplicate and the tree does not reference it, so the request's
own blocks for that part are freed by its decref (SGLang's dedup at insert).

KV addressing is by position: token i of every request lives at slot i % B of its block i // B.
A node covering tokens [s, e) holds one allocator reference on each block of indices
s // B .. (e - 1) // B, so a block that straddles a split is held by both halves. Where a parent and
a child hold different blocks for the same index, the child's block is the one to use: it was
written by a request whose whole prefix is the path, so its earlier slots are valid too.

Running requests lock the path they matched (lock_ref counts the requests below a node); an
unlocked leaf is evictable in LRU order of last access, where both match and insert refresh the
access time along the path. The cache is a `Reclaimer` on the allocator: its times come from the
same `time.monotonic` clock as the other reclaimers', so the allocator can compare them.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import NamedTuple

from kvsplice.cache.base import CacheSeq, PrefixCache, PrefixHit
from kvsplice.kv.allocator import BlockAllocator

ChildKey = int | tuple[int, ...]


class RadixEviction(NamedTuple):
    """A leaf the cache let go of: tokens start .. len(token_ids)-1 of the path are gone."""

    namespace: Hashable
    # The whole path from the root to the end of the evicted leaf.
    token_ids: tuple[int, ...]
    start: int


class _Node:
    __slots__ = ("blocks", "children", "key", "last_access", "lock_ref", "namespace", "parent", "start")

    def __init__(
        self, key: list[int], start: int, blocks: list[int], parent: _Node | None, last_access: float
    ) -> None:
        # The edge's tokens: this node covers tokens start .. start + len(key) - 1 of its path.
        self.key = key
        self.start = start
        # Blocks of indices start // B .. (end - 1) // B; one allocator reference on each.
        self.blocks = blocks
        self.children: dict[ChildKey, _Node] = {}
        # None for a namespace's root (and for a node once evicted).
        self.parent = parent
        # Running requests whose matched path goes through this node.
        self.lock_ref = 0
        self.last_access = last_access
        # Only meaningful on a root.
        self.namespace: Hashable = None

    @property
    def end(self) -> int:
        return self.start + len(self.key)


def _common_prefix_len(a: list[int], b: list[int], b_start: int, limit: int) -> int:
    """Leading equal tokens of a[:limit] and b[b_start : b_start + limit], with slice compares in C."""
    if a[:limit] == b[b_start : b_start + limit]:
        return limit
    n, step = 0, 64
    while n + step <= limit and a[n : n + step] == b[b_start + n : b_start + n + step]:
        n += step
    while a[n] == b[b_start + n]:
        n += 1
    return n


class RadixCache(PrefixCache):
    name = "radix"

    def __init__(
        self,
        allocator: BlockAllocator,
        page_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[RadixEviction], None] | None = None,
    ) -> None:
        """page_size: the matching granularity in tokens (SGLang's page size; 1 = token level).
        clock: access times; keep `time.monotonic` so other reclaimers' times compare (tests inject one).
        on_evict: told of each leaf evicted, like SGLang's BlockRemoved events (tests model the contents)."""
        super().__init__(allocator)
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._clock = clock
        self._on_evict = on_evict
        self._roots: dict[Hashable, _Node] = {}
        # request id -> deepest node of the path the request locked (None: it matched nothing).
        self._locked: dict[str, _Node | None] = {}
        # (last_access, tie-break, node) of evictable leaves; entries go stale and are skipped lazily.
        self._heap: list[tuple[float, int, _Node]] = []
        self._tie = itertools.count()
        self._num_nodes = 0
        self._num_tokens = 0
        allocator.add_reclaimer(self)

    @property
    def num_nodes(self) -> int:
        """Nodes in all trees, roots excluded."""
        return self._num_nodes

    @property
    def num_cached_tokens(self) -> int:
        return self._num_tokens

    # -- the engine's interface --------------------------------------------------------------------

    def acquire(self, seq: CacheSeq) -> PrefixHit:
        """Longest cached prefix of at most N-1 tokens (rounded down to a page); splits the node it
        ends in, refreshes access times along the path, locks the path and takes a reference on
        each block of the hit. When the hit ends inside a block the engine copies that block."""
        assert seq.num_computed == 0 and not seq.block_table, "acquire takes a fresh request"
        assert seq.request_id not in self._locked, f"request {seq.request_id!r} acquired twice"
        num_tokens = len(seq.keys)
        self.stats.queries += num_tokens
        limit = max(num_tokens - 1, 0) // self.page_size * self.page_size
        root = self._roots.get(seq.namespace)
        if root is None or limit == 0:
            self._locked[seq.request_id] = None
            return PrefixHit(0, ())
        node, matched = self._match(root, seq.keys, limit, self._clock())
        if matched == 0:
            self._locked[seq.request_id] = None
            return PrefixHit(0, ())
        blocks = [-1] * ((matched - 1) // self.block_size + 1)
        path = node
        while path.parent is not None:
            path.lock_ref += 1
            first = path.start // self.block_size
            # Walking up from the deepest node: a block index already filled belongs to a deeper node.
            for i, block in enumerate(path.blocks):
                if blocks[first + i] < 0:
                    blocks[first + i] = block
            path = path.parent
        assert min(blocks) >= 0, "the matched path does not cover every block of the hit"
        self._locked[seq.request_id] = node
        self.allocator.incref(blocks)
        self.stats.hits += matched
        return PrefixHit(matched, tuple(blocks))

    def peek(self, namespace: Hashable, token_ids: list[int]) -> int:
        """`acquire`'s match length, walked without touching or splitting a node."""
        limit = max(len(token_ids) - 1, 0) // self.page_size * self.page_size
        node, pos = self._roots.get(namespace), 0
        while node is not None and pos < limit:
            child = node.children.get(self._child_key(token_ids, pos))
            if child is None:
                break
            n = _common_prefix_len(child.key, token_ids, pos, min(len(child.key), limit - pos))
            n = n // self.page_size * self.page_size
            pos += n
            node = child if n == len(child.key) else None
        return pos

    def borrow(self, namespace: Hashable, token_ids: list[int]) -> PrefixHit:
        """`peek`'s walk without the N-1 cap, taking a reference on each block of the match."""
        path: list[_Node] = []
        node, pos = self._roots.get(namespace), 0
        while node is not None and pos < len(token_ids):
            child = node.children.get(self._child_key(token_ids, pos))
            if child is None:
                break
            n = _common_prefix_len(child.key, token_ids, pos, min(len(child.key), len(token_ids) - pos))
            n = n // self.page_size * self.page_size
            if n == 0:
                break
            path.append(child)
            pos += n
            node = child if n == len(child.key) else None
        if pos == 0:
            return PrefixHit(0, ())
        blocks = [-1] * ((pos - 1) // self.block_size + 1)
        # As in acquire: where nodes share a block index, the deepest node's block is the valid one.
        for step in reversed(path):
            first = step.start // self.block_size
            for i, block in enumerate(step.blocks[: len(blocks) - first]):
                if blocks[first + i] < 0:
                    blocks[first + i] = block
        assert min(blocks) >= 0, "the matched path does not cover every block of the hit"
        self.allocator.incref(blocks)
        return PrefixHit(pos, tuple(blocks))

    def on_computed(self, seq: CacheSeq) -> None:
        """Nothing to do: SGLang inserts a request's tokens when it finishes."""
        self._assert_covers(seq)

    def release(self, seq: CacheSeq) -> None:
        """Insert the computed tokens (page-aligned) with the request's blocks, unlock its path, then
        decref all its blocks: the ones the tree did not take (duplicates, the tail) are freed."""
        locked = self._locked.pop(seq.request_id)
        self._assert_covers(seq)
        length = seq.num_computed // self.page_size * self.page_size
        if length > 0:
            self._insert(seq.namespace, seq.keys, length, seq.block_table)
        node = locked
        while node is not None and node.parent is not None:
            assert node.lock_ref > 0, "unlock of a node that is not locked"
            node.lock_ref -= 1
            if node.lock_ref == 0 and not node.children:
                self._push(node)
            node = node.parent
        self.allocator.decref(reversed(seq.block_table))

    def _assert_covers(self, seq: CacheSeq) -> None:
        # Position-aligned KV: computed token i must have a block at index i // B.
        assert len(seq.block_table) * self.block_size >= seq.num_computed, (
            f"request {seq.request_id!r} has {seq.num_computed} tokens in {len(seq.block_table)} blocks"
        )

    # -- Reclaimer ---------------------------------------------------------------------------------

    def oldest_access(self) -> float | None:
        """Last access of the least recently used unlocked leaf; None if no leaf is evictable."""
        heap = self._heap
        while heap:
            last_access, _, node = heap[0]
            if self._is_evictable(node, last_access):
                return last_access
            heapq.heappop(heap)
        return None

    def reclaim_one(self) -> None:
        """Evict the least recently used unlocked leaf; its parent may become an evictable leaf."""
        assert self.oldest_access() is not None, "reclaim_one with nothing evictable"
        _, _, leaf = heapq.heappop(self._heap)
        parent = leaf.parent
        assert parent is not None
        if self._on_evict is not None:
            self._on_evict(self._eviction_event(leaf))
        if self.listener is not None:
            # The whole blocks that end inside the leaf: the ones its insertion reported stored.
            whole = leaf.end // self.block_size - leaf.start // self.block_size
            if whole > 0:
                self.listener.blocks_removed(leaf.blocks[:whole])
        del parent.children[self._child_key(leaf.key, 0)]
        leaf.parent = None
        self._num_nodes -= 1
        self._num_tokens -= len(leaf.key)
        # Tail first, as every release does; a block straddling into the parent keeps the parent's ref.
        self.allocator.decref(reversed(leaf.blocks))
        if parent.children:
            return
        if parent.parent is None:
            del self._roots[parent.namespace]
        elif parent.lock_ref == 0:
            self._push(parent)

    # -- the tree ----------------------------------------------------------------------------------

    def _child_key(self, tokens: list[int], pos: int) -> ChildKey:
        if self.page_size == 1:
            return tokens[pos]
        return tuple(tokens[pos : pos + self.page_size])

    def _match(self, root: _Node, tokens: list[int], length: int, now: float) -> tuple[_Node, int]:
        """Walk tokens[:length] (page-aligned) down from root, refreshing access times; split the node
        the match ends inside. Returns the deepest matched node and the number of tokens matched."""
        node, pos = root, 0
        node.last_access = now
        while pos < length:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            # The whole child is touched even if the match ends inside it, as in SGLang.
            self._touch(child, now)
            n = _common_prefix_len(child.key, tokens, pos, min(len(child.key), length - pos))
            n = n // self.page_size * self.page_size
            assert n > 0, "a child is keyed by its first page, so at least that page matches"
            pos += n
            if n < len(child.key):
                return self._split(child, n), pos
            node = child
        return node, pos

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut child after its first n tokens; the new upper node takes child's place. The block
        straddling the cut, if any, gains a reference: both halves hold it."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        block_size = self.block_size
        cut = child.start + n
        first = child.start // block_size
        upper_blocks = child.blocks[: (cut - 1) // block_size - first + 1]
        upper = _Node(child.key[:n], child.start, upper_blocks, parent, child.last_access)
        upper.lock_ref = child.lock_ref
        if cut % block_size:
            self.allocator.incref([child.blocks[cut // block_size - first]])
        child.blocks = child.blocks[cut // block_size - first :]
        child.key = child.key[n:]
        child.start = cut
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        parent.children[self._child_key(upper.key, 0)] = upper
        self._num_nodes += 1
        return upper

    def _insert(self, namespace: Hashable, tokens: list[int], length: int, block_table: list[int]) -> None:
        now = self._clock()
        root = self._roots.get(namespace)
        if root is None:
            root = _Node([], 0, [], None, now)
            root.namespace = namespace
            self._roots[namespace] = root
        node, matched = self._match(root, tokens, length, now)
        if matched == length:
            # Everything was cached already; node's access time changed, so re-queue it if evictable.
            if node.parent is not None and node.lock_ref == 0 and not node.children:
                self._push(node)
            return
        block_size = self.block_size
        blocks = block_table[matched // block_size : (length - 1) // block_size + 1]
        leaf = _Node(tokens[matched:length], matched, blocks, node, now)
        self.allocator.incref(blocks)
        first, end = matched // block_size, length // block_size
        if self.listener is not None and end > first:
            self.listener.blocks_stored(namespace, tokens[:length], first, block_table[first:end])
        node.children[self._child_key(leaf.key, 0)] = leaf
        self._num_nodes += 1
        self._num_tokens += len(leaf.key)
        self._push(leaf)

    def _touch(self, node: _Node, now: float) -> None:
        node.last_access = now
        if node.lock_ref == 0 and not node.children:
            self._push(node)

    # -- eviction order ----------------------------------------------------------------------------

    def _is_evictable(self, node: _Node, last_access: float) -> bool:
        # A heap entry is live if its node is still an unlocked leaf in a tree and was not touched since.
        return (
            node.parent is not None
            and node.lock_ref == 0
            and not node.children
            and node.last_access == last_access
        )

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._tie), node))
        if len(self._heap) > 2 * self._num_nodes + 1024:
            # Touches leave stale entries behind; drop them so the heap stays O(nodes).
            live: dict[int, tuple[float, int, _Node]] = {}
            for entry in self._heap:
                if self._is_evictable(entry[2], entry[0]):
                    live.setdefault(id(entry[2]), entry)
            self._heap = list(live.values())
            heapq.heapify(self._heap)

    def _eviction_event(self, leaf: _Node) -> RadixEviction:
        keys = []
        node = leaf
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        tokens = tuple(t for key in reversed(keys) for t in key)
        return RadixEviction(node.namespace, tokens, leaf.start)

    def check_invariants(self) -> Counter[int]:
        """Assert the tree's structure, locks and block spans (tests); return the references the tree
        holds per block, so a caller can check the allocator's counts against its own."""
        refs: Counter[int] = Counter()
        locks_here: Counter[int] = Counter(id(n) for n in self._locked.values() if n is not None)
        num_nodes = num_tokens = 0
        stack: list[_Node] = []
        for namespace, root in self._roots.items():
            assert root.parent is None and root.namespace == namespace and not root.key and root.lock_ref == 0
            assert root.children, "an empty tree is dropped"
            stack.extend(root.children.values())
        while stack:
            node = stack.pop()
            assert node.parent is not None
            num_nodes += 1
            num_tokens += len(node.key)
            assert node.key and len(node.key) % self.page_size == 0
            assert node.parent.children[self._child_key(node.key, 0)] is node
            assert node.start == node.parent.end
            span = (node.end - 1) // self.block_size - node.start // self.block_size + 1
            assert len(node.blocks) == span, f"[{node.start}, {node.end}) holds {len(node.blocks)} blocks"
            refs.update(node.blocks)
            assert node.lock_ref == locks_here[id(node)] + sum(c.lock_ref for c in node.children.values())
            stack.extend(node.children.values())
        assert num_nodes == self._num_nodes and num_tokens == self._num_tokens
        for block, count in refs.items():
            assert self.allocator.ref(block) >= count
        return refs
