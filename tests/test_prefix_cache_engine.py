"""Prefix caching in the engine: exact (same logits and greedy tokens as caching off), including after
evictions under a small KV budget and with requests running concurrently; per-request and engine-total
hit accounting; tenant isolation by cache salt."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvsplice import LLM, SamplingParams
from kvsplice.options import RequestOptions
from tests import tiny_models

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, return_first_logits=True)


@pytest.fixture(scope="module", params=["Gemma3ForCausalLM", "LlamaForCausalLM"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    tiny_models.save(request.param, directory)
    return directory


def _engine(model_dir: Path, cache: str, blocks: int) -> LLM:
    # 4 layers x (K, V) x 4 tokens x 2 heads x 16 dims x 4 bytes per block.
    block_bytes = 4 * 2 * BLOCK * 2 * 16 * 4
    # One thread: the tiny model's matrices are too small to split, and idle threads only spin.
    return LLM(
        model=str(model_dir),
        prefix_cache=cache,
        block_size=BLOCK,
        kv_cache_gb=blocks * block_bytes / 2**30,
        num_threads=1,
    )


def _stream(seed: int) -> list[list[list[int]]]:
    """Batches of token-id prompts sharing prefixes of every length, some extended turn by turn."""
    rng = random.Random(seed)
    base = [rng.randrange(1, 320) for _ in range(48)]
    batches = []
    for _ in range(6):
        batch = []
        for _ in range(rng.randint(1, 3)):
            cut = rng.randint(1, len(base))
            batch.append(base[:cut] + [rng.randrange(1, 320) for _ in range(rng.randint(1, 12))])
        batches.append(batch)
    return batches


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_cached_engine_equals_uncached(model_dir: Path, cache: str) -> None:
    # 40 blocks of 4 tokens: far less than the stream's prompts, so entries are evicted along the way.
    cached, plain = _engine(model_dir, cache, 40), _engine(model_dir, "off", 400)
    evictions = []
    prefix_cache = cached.engine.prefix_cache
    name = "_evict" if cache == "hash" else "reclaim_one"
    evict = getattr(prefix_cache, name)
    # Hash eviction hooks are registered as the bound attribute, so the spy sees them too.
    setattr(prefix_cache, name, lambda *args: (evictions.append(args), evict(*args))[1])
    hits = 0
    for batch in _stream(seed=7):
        got, want = cached.generate(batch, GREEDY), plain.generate(batch, GREEDY)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
            torch.testing.assert_close(g.first_logits, w.first_logits, atol=1e-4, rtol=1e-4)
            m = g.metrics
            assert m.prefix_hit_tokens + m.computed_tokens == m.prompt_tokens
            assert m.prefix_hit_tokens <= m.prompt_tokens - 1
            if cache == "hash":
                assert m.prefix_hit_tokens % BLOCK == 0
            hits += m.prefix_hit_tokens
        cached.engine.pool.allocator.check_invariants()
    assert hits > 0, "the stream shares prefixes: some must hit"
    assert evictions, "the budget is small: cached entries must have been evicted"
    stats = cached.engine.prefix_cache.stats
    assert stats.hits == hits
    # Everything is released when no request runs: only caches hold blocks (radix) or none (hash).
    pool = cached.engine.pool.allocator
    held = [b for b in range(pool.num_blocks) if pool.ref(b) > 0]
    assert cache == "radix" or not held


def test_multi_turn_conversation_hits_its_history(model_dir: Path) -> None:
    llm = _engine(model_dir, "radix", 400)
    prompt = list(range(1, 30))
    previous_kv = 0
    for _ in range(3):
        out = llm.generate([prompt], GREEDY)[0]
        # Everything but the new user tokens was computed before (the last generated token has no KV).
        assert out.metrics.prefix_hit_tokens == previous_kv
        previous_kv = len(prompt) + len(out.token_ids) - 1
        prompt = [*prompt, *out.token_ids, 5, 6, 7]


def test_engine_totals_count_queries_and_hits_in_tokens(model_dir: Path) -> None:
    llm = _engine(model_dir, "hash", 400)
    prompts = [list(range(1, 40)), [*range(1, 40), 9, 9], list(range(3, 20))]
    outs = [llm.generate([p], GREEDY)[0] for p in prompts]
    stats = llm.engine.prefix_cache.stats
    assert stats.queries == sum(len(p) for p in prompts)
    assert stats.hits == sum(o.metrics.prefix_hit_tokens for o in outs) == 36 + 0


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_cache_salt_isolates_tenants(model_dir: Path, cache: str) -> None:
    llm = _engine(model_dir, cache, 400)
    prompt = list(range(1, 40))
    llm.generate([prompt], GREEDY, RequestOptions(cache_salt="tenant-a"))
    other = llm.generate([prompt], GREEDY, RequestOptions(cache_salt="tenant-b"))[0]
    same = llm.generate([prompt], GREEDY, RequestOptions(cache_salt="tenant-a"))[0]
    unsalted = llm.generate(
        [prompt, prompt], GREEDY, [RequestOptions(), RequestOptions(cache_salt="tenant-b")]
    )
    assert other.metrics.prefix_hit_tokens == 0
    assert same.metrics.prefix_hit_tokens > 0
    assert unsalted[0].metrics.prefix_hit_tokens == 0
    assert unsalted[1].metrics.prefix_hit_tokens > 0
