"""The prefix caches behave as vLLM's and SGLang's do, case by case (the random streams are in
test_prefix_cache_properties.py). Every request goes through the checked simulator, so each of
these also checks hit contents, reference counts and the oracle."""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvsplice.cache.base import CacheSeq, NoPrefixCache
from kvsplice.cache.hash_chain import (
    SEED_HASH,
    BlockHasher,
    HashChainCache,
    encode_key,
    first_block_extra_keys,
)
from kvsplice.cache.radix import RadixCache
from kvsplice.cache.registry import make_prefix_cache
from kvsplice.errors import OutOfBlocksError
from kvsplice.kv.allocator import BlockAllocator
from tests.prefix_cache_sim import Simulator


def test_registry_builds_each_cache() -> None:
    alloc = BlockAllocator(8, 4)
    assert isinstance(make_prefix_cache("off", alloc), NoPrefixCache)
    assert isinstance(make_prefix_cache("hash", alloc), HashChainCache)
    radix = make_prefix_cache("radix", alloc)
    assert isinstance(radix, RadixCache) and radix.page_size == 1 and radix.block_size == 4
    with pytest.raises(ValueError, match="unknown prefix cache"):
        make_prefix_cache("lru", alloc)


# -- block boundaries: vLLM hits whole blocks, SGLang any token ------------------------------------


@pytest.mark.parametrize(("kind", "expected"), [("hash", 992), ("radix", 1000)])
def test_shared_1000_token_prefix(kind: str, expected: int) -> None:
    sim = Simulator(kind, 200, 16)
    prefix = list(range(1000))
    sim.run(0, [*prefix, 5000, 5001])
    assert sim.run(0, [*prefix, 6000]) == expected
    sim.drain()


@pytest.mark.parametrize(("kind", "expected"), [("hash", 0), ("radix", 15)])
def test_15_of_16_equal_tokens(kind: str, expected: int) -> None:
    sim = Simulator(kind, 20, 16)
    sim.run(0, [*range(16), 100])
    assert sim.run(0, [*range(15), 99, 100, 101]) == expected
    sim.drain()


@pytest.mark.parametrize(("kind", "expected"), [("hash", 16), ("radix", 31)])
def test_prompt_a_multiple_of_the_block_recomputes_its_last_token(kind: str, expected: int) -> None:
    # N = 32 tokens cached, the same N again: the last token must be computed for its logits, and
    # vLLM recomputes that whole last block.
    sim = Simulator(kind, 20, 16)
    sim.run(0, list(range(32)))
    assert sim.run(0, list(range(32))) == expected
    sim.drain()


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_namespaces_share_nothing(kind: str) -> None:
    sim = Simulator(kind, 40, 4)
    prompt = list(range(20))
    sim.run(("model", "salt-a"), prompt)
    assert sim.run(("model", "salt-b"), prompt) == 0
    assert sim.run(("other-model", "salt-a"), prompt) == 0
    assert sim.run(("model", "salt-a"), prompt) > 0
    sim.drain()


# -- hash chain ------------------------------------------------------------------------------------


def test_block_hash_is_sha256_over_the_chain() -> None:
    hasher = BlockHasher(4)
    extra = first_block_extra_keys(("m", "salt"))
    first = hasher(SEED_HASH, [1, 2, 3, 4], extra)
    expected = hashlib.sha256(SEED_HASH + struct.pack("<4q", 1, 2, 3, 4) + extra).digest()
    assert first == expected
    second = hasher(first, [5, 6, 7, 8], encode_key(None))
    assert second != hasher(SEED_HASH, [5, 6, 7, 8], encode_key(None))
    assert first != hasher(SEED_HASH, [1, 2, 3, 4], first_block_extra_keys(("m", "other")))


def test_namespace_encoding_is_canonical() -> None:
    # Equal namespaces encode alike whether or not they share objects (pickle's memo would not).
    salt = "s" * 10
    assert encode_key((salt, salt)) == encode_key(("s" * 10, "".join(["s"] * 10)))
    assert encode_key((1, "1", b"1", None, True)) != encode_key((True, "1", b"1", None, 1))
    assert encode_key(("a", "bc")) != encode_key(("ab", "c"))
    with pytest.raises(TypeError, match="namespace"):
        encode_key(("model", 1.5))


def test_hash_registers_blocks_filled_by_decoding() -> None:
    sim = Simulator("hash", 40, 4)
    # 6 prompt tokens + 5 decoded: tokens 0..10 computed, so blocks 0 and 1 (tokens 0..7) are full.
    sim.run(0, [1, 2, 3, 4, 5, 6], decode_tokens=(7, 8, 9, 10, 11))
    assert sim.run(0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 99]) == 8
    sim.drain()


def test_hash_release_puts_the_chain_tail_first_in_the_free_queue() -> None:
    sim = Simulator("hash", 4, 4)
    prompt = list(range(13))  # 3 full blocks and a partial one: the whole pool
    cache = sim.cache
    assert isinstance(cache, HashChainCache)
    sim.run(0, prompt)
    assert cache.num_cached_blocks == 3
    # The partial block comes back first, then the chain from its tail.
    sim.drop(sim.allocate(2))
    assert cache.num_cached_blocks == 2
    assert sim.run(0, prompt) == 8
    sim.drain()


def test_hash_hit_touches_blocks_to_the_lru_tail() -> None:
    sim = Simulator("hash", 6, 4)
    x, y = [1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]
    sim.run(0, x)  # released before y: older
    sim.run(0, y)
    assert sim.run(0, x) == 8  # the hit takes x's blocks out of the queue; released after y's
    sim.drop(sim.allocate(3))  # evicts the three blocks at the queue's head: y's
    assert sim.run(0, x) == 8
    assert sim.run(0, y) == 0
    sim.drain()


def test_hash_keeps_duplicates_and_hits_the_first_registered() -> None:
    sim = Simulator("hash", 20, 4)
    prompt = list(range(9))
    a, b = sim.admit(0, prompt), sim.admit(0, prompt)
    assert a is not None and b is not None and a.hit.num_tokens == b.hit.num_tokens == 0
    sim.prefill(a, 0)
    sim.prefill(b, 0)  # the same two blocks, computed twice: both registered
    assert sim.counts.duplicate_blocks == 2
    c = sim.admit(0, prompt)
    assert c is not None and c.hit.blocks == tuple(a.seq.block_table[:2])
    sim.prefill(c, 0)
    a_blocks, b_blocks = a.seq.block_table[:2], b.seq.block_table[:2]
    for req in (c, a, b):
        sim.finish(req)
    # Free queue: 13 untouched blocks, c's tail, a's blocks (tail first), b's. Evict through a's.
    sim.drop(sim.allocate(13 + 1 + 3))
    assert not any(sim.alloc.ref(block) for block in a_blocks + b_blocks)
    d = sim.admit(0, prompt)
    assert d is not None and d.hit.blocks == tuple(b_blocks)
    sim.drain()


def test_hash_blocks_stay_cached_in_the_free_queue() -> None:
    sim = Simulator("hash", 8, 4)
    cache = sim.cache
    assert isinstance(cache, HashChainCache)
    sim.run(0, list(range(9)))
    assert sim.alloc.num_free == 8 and cache.num_cached_blocks == 2
    sim.drain()


# -- radix tree ------------------------------------------------------------------------------------


def test_radix_split_inside_a_block_shares_it() -> None:
    sim = Simulator("radix", 40, 4)
    cache = sim.cache
    assert isinstance(cache, RadixCache)
    sim.run(0, [1, 2, 3, 4, 5, 6, 7])  # one node, tokens 0..6, blocks 0 and 1
    assert cache.num_nodes == 1
    req = sim.admit(0, [1, 2, 3, 9, 9])  # ends inside the node, inside block 0: split, partial copy
    assert req is not None and req.hit.num_tokens == 3 and sim.counts.partial_hits == 1
    assert cache.num_nodes == 2
    block0 = req.hit.blocks[0]
    assert cache.check_invariants()[block0] == 2  # held by both halves of the split
    sim.prefill(req, 0)
    sim.finish(req)  # inserts a sibling: [1, 2, 3] -> {[4, 5, 6, 7], [9, 9]}
    assert cache.num_nodes == 3
    assert sim.run(0, [1, 2, 3, 4, 5, 6, 7, 8]) == 7
    assert sim.run(0, [1, 2, 3, 9, 9, 8]) == 5
    sim.drain()


def test_radix_page_size_rounds_matches_down() -> None:
    sim = Simulator("radix", 40, 4, page_size=2)
    sim.run(0, [1, 2, 3, 4, 5])  # 5 computed tokens, 4 inserted
    assert sim.run(0, [1, 2, 3, 4, 5, 6]) == 4
    assert sim.run(0, [1, 2, 3, 9]) == 2
    sim.drain()


def test_radix_lock_prevents_eviction() -> None:
    sim = Simulator("radix", 8, 4)
    cache = sim.cache
    assert isinstance(cache, RadixCache)
    prompt = list(range(9))
    sim.run(0, prompt)  # 9 tokens cached in 3 blocks
    req = sim.admit(0, [*prompt, 100])
    assert req is not None and req.hit.num_tokens == 9
    sim.prefill(req, 0)
    assert cache.oldest_access() is None  # the whole tree is locked by the running request
    with pytest.raises(OutOfBlocksError):
        sim.allocate(sim.alloc.num_free + 1)
    sim.finish(req)
    assert cache.oldest_access() is not None
    sim.drop(sim.allocate(8))  # everything evictable now
    assert cache.num_nodes == 0
    sim.drain()


def test_radix_evicts_least_recently_used_leaf_first() -> None:
    sim = Simulator("radix", 40, 4)
    cache = sim.cache
    assert isinstance(cache, RadixCache)
    x, y, z = [1, 1, 1, 1, 1], [2, 2, 2, 2, 2], [3, 3, 3, 3, 3]
    sim.run(0, x)
    sim.run(0, y)
    sim.run(0, z)
    sim.run(0, [*x[:3], 9])  # touches x's path (and splits it): x is now newer than y and z
    cache.reclaim_one()
    cache.reclaim_one()
    assert [e.token_ids[0] for e in sim.radix_evictions] == [2, 3]
    assert sim.run(0, [*x, 0]) == 5 and sim.run(0, [*y, 0]) == 0
    sim.drain()


def test_radix_parent_becomes_evictable_when_its_last_child_goes() -> None:
    sim = Simulator("radix", 40, 4)
    cache = sim.cache
    assert isinstance(cache, RadixCache)
    sim.run(0, [1, 2, 3, 4, 5, 6])
    sim.run(0, [1, 2, 3, 7, 8, 9])  # [1, 2, 3] -> {[4, 5, 6], [7, 8, 9]}
    assert cache.num_nodes == 3
    for _ in range(3):
        cache.reclaim_one()
    assert [(e.start, len(e.token_ids)) for e in sim.radix_evictions] == [(3, 6), (3, 6), (0, 3)]
    assert cache.oldest_access() is None
    sim.drain()


def test_radix_dedup_at_insert_frees_the_duplicate_blocks() -> None:
    sim = Simulator("radix", 40, 4)
    cache = sim.cache
    assert isinstance(cache, RadixCache)
    prompt = list(range(8))
    a, b = sim.admit(0, prompt), sim.admit(0, prompt)
    assert a is not None and b is not None
    sim.prefill(a, 0)
    sim.prefill(b, 0)
    a_blocks, b_blocks = list(a.seq.block_table), list(b.seq.block_table)
    sim.finish(a)
    sim.finish(b)  # its 8 tokens are all in the tree already: its blocks are not referenced
    assert all(sim.alloc.is_free(block) for block in b_blocks)
    assert sorted(cache.check_invariants()) == sorted(a_blocks)
    sim.drain()


def test_radix_insert_past_the_tree_references_the_straddling_block() -> None:
    sim = Simulator("radix", 40, 4)
    cache = sim.cache
    assert isinstance(cache, RadixCache)
    sim.run(0, [1, 2, 3, 4, 5, 6])  # tokens 0..5 cached
    req = sim.admit(0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert req is not None and req.hit.num_tokens == 6
    sim.prefill(req, 0)
    own_block1 = req.seq.block_table[1]  # the copy of the partial block, then tokens 6, 7
    sim.finish(req)
    # The new node covers tokens 6..9: the request's blocks 1 and 2; block 1 overlaps the parent.
    assert cache.check_invariants()[own_block1] == 1
    assert sim.run(0, [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    sim.drain()


def test_radix_acquire_contract() -> None:
    alloc = BlockAllocator(8, 4)
    cache = RadixCache(alloc)
    seq = CacheSeq("r", 0, [1, 2, 3])
    assert cache.acquire(seq).num_tokens == 0
    with pytest.raises(AssertionError, match="acquired twice"):
        cache.acquire(CacheSeq("r", 0, [1, 2, 3]))
    assert cache.stats.queries == 3 and cache.stats.hits == 0


def test_segment_keys_tell_markup_and_settings_apart() -> None:
    from kvsplice.cache.segment_keys import SegmentKeys
    from kvsplice.prompt import ParsedPrompt, SegmentSpan

    keys = SegmentKeys(vocab_size=100)
    ids = (5, 6, 7, 8, 9, 6, 7)
    one = ParsedPrompt(ids, (SegmentSpan(1, 5),))
    two = ParsedPrompt(ids, (SegmentSpan(1, 3), SegmentSpan(3, 5)))
    a = keys(one, "recency@15", 1)
    # Tokens before the first spliced one keep their ids; every token from it on gets an id above the
    # vocabulary, the same every time, after the segment too (its KV read the spliced KV).
    assert a[0] == 5 and min(a[1:]) >= 100 and keys(one, "recency@15", 1) == a
    # Token 6 where a segment starts is not token 6 elsewhere; elsewhere, a token is keyed alike.
    assert a[1] != a[5] and a[2] == a[6]
    # Where a segment starts, where splicing starts and the repair settings are part of the key.
    assert keys(two, "recency@15", 1)[3] != a[3] and keys(two, "recency@15", 1)[4] == a[4]
    assert keys(one, "recency@15", 3)[1:3] == [6, 7]
    assert all(x != y for x, y in zip(keys(one, "none@0", 1)[1:], a[1:], strict=True))
    assert keys.generated(6, "recency@15") == a[5]


def test_segment_keys_remember_a_bounded_number_of_settings() -> None:
    from kvsplice.cache.segment_keys import MAX_SETTINGS, SegmentKeys
    from kvsplice.prompt import ParsedPrompt, SegmentSpan

    keys = SegmentKeys(vocab_size=100)
    prompt = ParsedPrompt((5, 6, 7, 8), (SegmentSpan(1, 3),))
    first = keys(prompt, "ratio 0", 1)
    seen = {tuple(first)}
    for i in range(1, 1000):
        seen.add(tuple(keys(prompt, f"ratio {i}", 1)))
        assert keys.num_settings <= MAX_SETTINGS
    # Every setting had keys of its own, and the first, forgotten, gets new ones: never another's.
    assert len(seen) == 1000
    again = keys(prompt, "ratio 0", 1)
    assert again != first and tuple(again) not in seen and again[0] == 5
    # Recently used settings are kept: their keys stay the same.
    assert keys(prompt, "ratio 999", 1) == keys(prompt, "ratio 999", 1)


def test_segment_keys_start_where_the_first_span_is_found() -> None:
    from kvsplice.cache.segment_keys import SegmentKeys
    from kvsplice.prompt import ParsedPrompt, SegmentSpan

    keys = SegmentKeys(vocab_size=100)
    ids = list(range(10, 30))
    prompt = ParsedPrompt(tuple(ids), (SegmentSpan(12, 16),))
    cached: list[list[int]] = []

    def peek(x: list[int]) -> int:
        return max(
            (
                next((i for i, (p, q) in enumerate(zip(c, x, strict=False)) if p != q), min(len(c), len(x)))
                for c in cached
            ),
            default=0,
        )

    # Nothing spliced or an exact repair: plain ids.
    assert keys.choose(ParsedPrompt(tuple(ids)), "s", True, peek).approximate_from is None
    assert keys.choose(prompt, "s", False, peek, 4).approximate_from is None
    # A span found before the first marked segment (after the plain prefix hit): segment keys start there.
    cached.append(ids[:3])
    chosen = keys.choose(prompt, "s", True, peek, 4)
    assert chosen.approximate_from == 4 and chosen.ids[:4] == ids[:4] and min(chosen.ids[4:]) >= 100
    assert keys.choose(prompt, "s", True, peek).approximate_from == 12
    # Spans are found after the plain prefix hit, never inside it.
    with pytest.raises(AssertionError, match="after the plain prefix hit"):
        keys.choose(prompt, "s", True, peek, 2)
    # A plain prefix that runs past the first spliced position wins.
    cached.append(ids[:15])
    assert keys.choose(prompt, "s", True, peek, None).approximate_from is None
