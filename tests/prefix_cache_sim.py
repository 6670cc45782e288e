"""A checked stand-in for the engine, to drive a prefix cache without a model.

It plays the engine's part for each request (acquire, copy a partial hit block, allocate, prefill,
decode, release) and checks everything it can see from outside the cache:

- a fake KV store: every slot written holds a fingerprint of (namespace, the tokens up to and
  including its own), so a hit whose blocks do not really hold the requested tokens at the right
  slots, or a block handed out while a running request holds it, shows up as a wrong fingerprint;
- an oracle of the cache's contents, kept independently of the cache: for the hash chain, the
  prefix each full block was registered with, dropped when the allocator hands that block out
  again; for the radix tree, the sequences inserted, cut back as the cache reports evictions. Each
  acquire must hit exactly what the oracle says;
- reference counts: the allocator's count of every block equals the references the simulator's
  running requests hold plus those the cache says it holds.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

from kvsplice.cache.base import CacheSeq, PrefixCache, PrefixHit
from kvsplice.cache.hash_chain import HashChainCache
from kvsplice.cache.radix import RadixCache, RadixEviction
from kvsplice.errors import OutOfBlocksError
from kvsplice.kv.allocator import BlockAllocator


def fingerprints(namespace: Hashable, token_ids: list[int]) -> list[int]:
    """fps[i] names the KV of token i: it depends on the namespace and on tokens 0 .. i."""
    fps, fp = [], hash(("ns", namespace))
    for token in token_ids:
        fp = hash((fp, token))
        fps.append(fp)
    return fps


@dataclass
class SimRequest:
    seq: CacheSeq
    fps: list[int]
    decode_left: int
    hit: PrefixHit
    prefilled: bool = False
    # Hash oracle: blocks 0 .. num_registered-1 of this request are in the model.
    num_registered: int = 0


@dataclass
class SimCounts:
    hit_tokens: int = 0
    partial_hits: int = 0
    aborted: int = 0
    finished: int = 0
    evicted_hash_blocks: int = 0
    evicted_radix_leaves: int = 0
    # Hash chain: a block registered under a hash another block already has (computed concurrently).
    duplicate_blocks: int = 0


@dataclass
class Simulator:
    kind: str  # "hash" | "radix"
    num_blocks: int
    block_size: int
    page_size: int = 1
    alloc: BlockAllocator = field(init=False)
    cache: PrefixCache = field(init=False)
    counts: SimCounts = field(default_factory=SimCounts)

    def __post_init__(self) -> None:
        self.alloc = BlockAllocator(self.num_blocks, self.block_size)
        self.kv: dict[int, list[int | None]] = {}
        self.running: dict[str, SimRequest] = {}
        # References the simulated engine holds, per block.
        self.held: Counter[int] = Counter()
        # Hash oracle: block -> fingerprint of its last token; fingerprint -> blocks (registration order).
        self.hash_entries: dict[int, int] = {}
        self.hash_index: dict[int, dict[int, None]] = {}
        # Radix oracle: the token sequences the tree holds (the tree is their prefix closure).
        self.radix_seqs: dict[Hashable, list[tuple[int, ...]]] = {}
        self.radix_evictions: list[RadixEviction] = []
        self._ids = itertools.count()
        if self.kind == "hash":
            self.cache = HashChainCache(self.alloc)
        elif self.kind == "radix":
            clock = itertools.count()
            self.cache = RadixCache(
                self.alloc, self.page_size, clock=lambda: float(next(clock)), on_evict=self._radix_evicted
            )
        else:
            raise ValueError(self.kind)

    # -- the engine's steps ------------------------------------------------------------------------

    def admit(self, namespace: Hashable, prompt: list[int], decode: int = 0) -> SimRequest | None:
        """Acquire, copy a partial hit block, allocate the prompt's blocks. None if it had to abort."""
        assert prompt
        seq = CacheSeq(f"r{next(self._ids)}", namespace, list(prompt))
        fps = fingerprints(namespace, seq.keys)
        expected = self.expected_hit(namespace, seq.keys, fps)
        assert self.cache.peek(namespace, seq.keys) == expected[0], "peek disagrees with the oracle"
        hit = self.cache.acquire(seq)
        B = self.block_size
        assert hit.num_tokens == expected[0], f"hit {hit.num_tokens} tokens, oracle says {expected[0]}"
        if expected[1] is not None:
            assert list(hit.blocks) == expected[1], "not the first registered duplicate"
        assert len(hit.blocks) == -(-hit.num_tokens // B)
        self.held.update(hit.blocks)
        self.check_kv(hit.blocks, fps, hit.num_tokens)
        self.counts.hit_tokens += hit.num_tokens
        req = SimRequest(seq, fps, decode, hit, num_registered=len(hit.blocks))
        seq.block_table = list(hit.blocks)
        seq.num_computed = hit.num_tokens
        self.running[seq.request_id] = req
        try:
            if hit.num_tokens % B:
                # The last hit block is shared and partly valid: copy its valid slots into our own.
                self.counts.partial_hits += 1
                shared = seq.block_table[-1]
                [own] = self.allocate(1)
                valid = hit.num_tokens % B
                self.kv[own][:valid] = self.kv[shared][:valid]
                seq.block_table[-1] = own
                self.drop([shared])
            seq.block_table += self.allocate(-(-len(prompt) // B) - len(seq.block_table))
        except OutOfBlocksError:
            self.abort(req)
            return None
        return req

    def prefill(self, req: SimRequest, next_token: int) -> None:
        seq = req.seq
        assert not req.prefilled
        self.write(req, seq.num_computed, len(seq.keys))
        seq.num_computed = len(seq.keys)
        self.cache.on_computed(seq)
        self.register(req)
        req.prefilled = True
        self.sample(req, next_token)

    def decode(self, req: SimRequest, next_token: int) -> bool:
        """One decode step (computes the last sampled token); False if it had to abort."""
        seq = req.seq
        assert req.prefilled and req.decode_left > 0
        if seq.num_computed // self.block_size >= len(seq.block_table):
            try:
                seq.block_table += self.allocate(1)
            except OutOfBlocksError:
                self.abort(req)
                return False
        self.write(req, seq.num_computed, seq.num_computed + 1)
        seq.num_computed += 1
        self.cache.on_computed(seq)
        self.register(req)
        req.decode_left -= 1
        self.sample(req, next_token)
        return True

    def finish(self, req: SimRequest) -> None:
        seq = req.seq
        # Nothing this request wrote (or copied) was overwritten while it ran.
        self.check_kv(seq.block_table, req.fps, seq.num_computed)
        self.counts.finished += 1
        self.release(req)

    def abort(self, req: SimRequest) -> None:
        self.counts.aborted += 1
        self.release(req)

    def release(self, req: SimRequest) -> None:
        seq = req.seq
        if self.kind == "radix":
            assert isinstance(self.cache, RadixCache)
            length = seq.num_computed // self.cache.page_size * self.cache.page_size
            if length:
                self.radix_seqs.setdefault(seq.namespace, []).append(tuple(seq.keys[:length]))
        del self.running[seq.request_id]
        self.held.subtract(seq.block_table)
        self.cache.release(seq)

    def run(
        self, namespace: Hashable, prompt: list[int], decode_tokens: list[int] | tuple[int, ...] = ()
    ) -> int:
        """One request from start to end; returns its hit. Raises if it had to abort."""
        req = self.admit(namespace, prompt, len(decode_tokens))
        assert req is not None, "the request did not fit"
        tokens = [*decode_tokens, 0]
        self.prefill(req, tokens[0])
        for token in tokens[1:]:
            assert self.decode(req, token)
        self.finish(req)
        return req.hit.num_tokens

    # -- memory ------------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        blocks = self.alloc.allocate(n)
        for block in blocks:
            assert self.held[block] == 0, f"block {block} handed out while a running request holds it"
            self.kv[block] = [None] * self.block_size
            key = self.hash_entries.pop(block, None)
            if key is not None:
                self.counts.evicted_hash_blocks += 1
                del self.hash_index[key][block]
                if not self.hash_index[key]:
                    del self.hash_index[key]
        self.held.update(blocks)
        return blocks

    def drop(self, blocks: list[int]) -> None:
        self.held.subtract(blocks)
        self.alloc.decref(blocks)

    def write(self, req: SimRequest, start: int, end: int) -> None:
        table, B = req.seq.block_table, self.block_size
        for i in range(start, end):
            block = table[i // B]
            # Writing into a block someone else can see would corrupt cached KV.
            assert self.alloc.ref(block) == 1, (
                f"write into block {block} with {self.alloc.ref(block)} holders"
            )
            self.kv[block][i % B] = req.fps[i]

    def sample(self, req: SimRequest, token: int) -> None:
        req.seq.keys.append(token)
        req.fps.append(hash((req.fps[-1], token)))

    def check_kv(self, blocks: list[int] | tuple[int, ...], fps: list[int], num_tokens: int) -> None:
        B = self.block_size
        for i in range(num_tokens):
            assert self.kv[blocks[i // B]][i % B] == fps[i], f"token {i}: wrong KV in block {blocks[i // B]}"

    # -- the oracle --------------------------------------------------------------------------------

    def expected_hit(
        self, namespace: Hashable, tokens: list[int], fps: list[int]
    ) -> tuple[int, list[int] | None]:
        """(tokens that must hit, the blocks for the hash cache) from the independent model."""
        limit = len(tokens) - 1
        B = self.block_size
        if self.kind == "hash":
            blocks: list[int] = []
            while (len(blocks) + 1) * B <= limit:
                entry = self.hash_index.get(fps[(len(blocks) + 1) * B - 1])
                if not entry:
                    break
                blocks.append(next(iter(entry)))
            return len(blocks) * B, blocks
        best = 0
        for cached in self.radix_seqs.get(namespace, []):
            n = 0
            for a, b in zip(cached, tokens, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, limit) // self.page_size * self.page_size, None

    def register(self, req: SimRequest) -> None:
        if self.kind != "hash":
            return
        B = self.block_size
        for j in range(req.num_registered, req.seq.num_computed // B):
            key = req.fps[(j + 1) * B - 1]
            block = req.seq.block_table[j]
            if self.hash_index.get(key):
                self.counts.duplicate_blocks += 1
            self.hash_entries[block] = key
            self.hash_index.setdefault(key, {})[block] = None
            req.num_registered = j + 1

    def _radix_evicted(self, event: RadixEviction) -> None:
        self.counts.evicted_radix_leaves += 1
        self.radix_evictions.append(event)
        seqs = self.radix_seqs[event.namespace]
        path, start = event.token_ids, event.start
        # A leaf is keyed by its first page: sequences sharing that page run into it.
        first_page = start + self.page_size
        kept = []
        for cached in seqs:
            if len(cached) >= first_page and cached[:first_page] == path[:first_page]:
                # It runs into the evicted leaf, so it must end inside it: a leaf has no children.
                assert len(cached) <= len(path) and cached == path[: len(cached)], "evicted a non-leaf"
                cached = cached[:start]
            if cached:
                kept.append(cached)
        self.radix_seqs[event.namespace] = kept

    # -- checks ------------------------------------------------------------------------------------

    def check(self) -> None:
        """Allocator invariants, cache invariants, and every block's count equals its holders."""
        self.alloc.check_invariants()
        cache_refs: Counter[int] = Counter()
        if isinstance(self.cache, RadixCache):
            cache_refs = self.cache.check_invariants()
        else:
            assert isinstance(self.cache, HashChainCache)
            self.cache.check_invariants()
            assert self.cache.num_cached_blocks == len(self.hash_entries)
        for block in range(self.num_blocks):
            assert self.alloc.ref(block) == self.held[block] + cache_refs[block], f"block {block} ref count"

    def drain(self) -> None:
        """Finish every running request, evict every cache entry, and check that nothing is held."""
        for req in list(self.running.values()):
            self.finish(req)
        if isinstance(self.cache, RadixCache):
            while self.cache.oldest_access() is not None:
                self.cache.reclaim_one()
            assert self.cache.num_nodes == 0 and self.cache.num_cached_tokens == 0
            assert not any(self.radix_seqs.values()), "the oracle still has sequences the cache evicted"
        self.check()
        assert self.alloc.num_free == self.num_blocks, "blocks are still held after everything finished"
