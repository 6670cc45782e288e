"""Splicing reused segments: exactness where it must be exact, accounting, and the cache interplay.

Tiny random-weight models of several architectures (Gemma 3 with a 24-token window shorter than the
segments, Llama with llama3 RoPE scaling, Qwen2 with windows on some layers) and token-id prompts.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvsplice import LLM, SamplingParams, Segment
from kvsplice.kv import rope
from kvsplice.model_config import RopeSpec
from kvsplice.options import RequestOptions
from kvsplice.repair.shift import FAMILY_SHIFT
from tests import tiny_models

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, return_first_logits=True)
ARCHS = ["Gemma3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"]


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    tiny_models.save(request.param, directory)
    return directory


def _llm(model_dir: Path, **kwargs) -> LLM:
    kwargs = {"block_size": 8, "kv_cache_gb": 0.01, "num_threads": 1, **kwargs}
    return LLM(model=str(model_dir), **kwargs)


rng = random.Random(0)
SYSTEM = [rng.randrange(1, 320) for _ in range(11)]
DOCS = [[rng.randrange(1, 320) for _ in range(rng.randint(28, 45))] for _ in range(4)]
QUESTION = [rng.randrange(1, 320) for _ in range(9)]


def _parts(order: list[int], segments: bool = True) -> list:
    docs = [Segment(DOCS[i]) if segments else DOCS[i] for i in order]
    return [SYSTEM, *docs, QUESTION]


def _warm(llm: LLM) -> None:
    """Put every document in the segment store (computed on its own)."""
    llm.generate([_parts([0, 1, 2, 3])], GREEDY)


def test_full_repair_equals_a_full_prefill(model_dir: Path) -> None:
    llm = _llm(model_dir, prefix_cache="radix", repair="full")
    reference = _llm(model_dir, prefix_cache="off")
    _warm(llm)
    for order in ([2, 0, 3, 1], [1, 3], [3, 2, 1, 0]):
        got = llm.generate([_parts(order)], GREEDY)[0]
        want = reference.generate([_parts(order, segments=False)], GREEDY)[0]
        assert got.metrics.segment_hit_tokens > 0
        torch.testing.assert_close(got.first_logits, want.first_logits, atol=1e-4, rtol=1e-4)
        assert got.token_ids == want.token_ids


def test_segment_at_its_canonical_place_equals_the_prefix_cached_request(model_dir: Path) -> None:
    """With no BOS the canonical context is empty: a segment opening the prompt sits exactly where it was
    computed, after the same (empty) context, so naive reuse is exact there."""
    spliced = _llm(model_dir, prefix_cache="off", repair="none")
    prefixed = _llm(model_dir, prefix_cache="radix")
    spliced.generate([[Segment(DOCS[0]), [7]]], GREEDY)
    prefixed.generate([[*DOCS[0], 7]], GREEDY)
    got = spliced.generate([[Segment(DOCS[0]), QUESTION]], GREEDY)[0]
    want = prefixed.generate([[*DOCS[0], *QUESTION]], GREEDY)[0]
    assert got.metrics.segment_hit_tokens == len(DOCS[0]) and want.metrics.prefix_hit_tokens == len(DOCS[0])
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=1e-4, rtol=1e-4)
    assert got.token_ids == want.token_ids


@pytest.mark.parametrize(
    "policy, ratios",
    [
        ("none", [0.0]),
        ("boundary", [0.1, 0.3]),
        ("deviation", [0.1, 0.3]),
        ("attention", [0.1, 0.3]),
    ],
)
def test_metrics_add_up_and_recompute_stays_in_budget(
    model_dir: Path, policy: str, ratios: list[float]
) -> None:
    llm = _llm(model_dir, prefix_cache="radix", repair=policy)
    _warm(llm)
    for ratio in ratios:
        out = llm.generate([_parts([3, 1, 0, 2])], GREEDY, RequestOptions(recompute_ratio=ratio))[0]
        m = out.metrics
        assert m.prefix_hit_tokens + m.segment_hit_tokens + m.computed_tokens == m.prompt_tokens
        # The system prompt is an exact prefix hit from the warm-up request (and so are reused tokens
        # that an earlier request recomputed before any approximate KV), the documents are spliced.
        assert m.prefix_hit_tokens >= len(SYSTEM) and m.computed_tokens == len(QUESTION)
        assert m.prefix_hit_tokens + m.segment_hit_tokens == len(SYSTEM) + sum(len(d) for d in DOCS)
        assert m.recomputed_tokens == round(ratio * m.segment_hit_tokens)


def test_a_turn_that_extends_a_spliced_request_reuses_its_kv(model_dir: Path) -> None:
    """The next turn of a spliced request takes the request's own KV (approximate, under segment keys)
    as its prefix: it reads exactly the KV the previous answer came from, so its greedy continuation
    is the previous one's, one token on. No other request can take that KV."""
    llm = _llm(model_dir, prefix_cache="radix", repair="boundary", recompute_ratio=0.2)
    _warm(llm)
    parts = _parts([2, 0, 3])
    first = llm.generate([parts], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert first.metrics.segment_hit_tokens == sum(len(DOCS[i]) for i in (2, 0, 3))
    n = len(first.prompt_token_ids)
    follow = [*parts[:-1], [*QUESTION, first.token_ids[0]]]
    second = llm.generate([follow], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    m = second.metrics
    assert (m.prefix_hit_tokens, m.segment_hit_tokens, m.computed_tokens) == (n, 0, 1)
    assert second.token_ids == first.token_ids[1:]

    # Other repair settings, or the same tokens without segment markup: only the instruction is shared.
    other = llm.generate([follow], GREEDY, RequestOptions(recompute_ratio=0.5))[0]
    assert other.metrics.prefix_hit_tokens == len(SYSTEM)
    plain = llm.generate([[*SYSTEM, *DOCS[2], *DOCS[0], *DOCS[3], *QUESTION]], GREEDY)[0]
    assert plain.metrics.prefix_hit_tokens == len(SYSTEM)
    reference = _llm(model_dir, prefix_cache="off").generate([plain.prompt_token_ids], GREEDY)[0]
    torch.testing.assert_close(plain.first_logits, reference.first_logits, atol=1e-4, rtol=1e-4)


def test_reuse_continues_past_a_missing_segment(model_dir: Path) -> None:
    llm = _llm(model_dir, prefix_cache="off")
    llm.generate([[Segment(DOCS[0]), Segment(DOCS[2]), [5]]], GREEDY)
    out = llm.generate([[SYSTEM, Segment(DOCS[2]), Segment(DOCS[1]), Segment(DOCS[0]), QUESTION]], GREEDY)[0]
    assert out.metrics.segment_hit_tokens == len(DOCS[0]) + len(DOCS[2])
    assert out.metrics.computed_tokens == len(SYSTEM) + len(DOCS[1]) + len(QUESTION)
    # The missed segment was stored afterwards: a third request reuses all three.
    again = llm.generate([[SYSTEM, Segment(DOCS[1]), Segment(DOCS[0]), Segment(DOCS[2]), QUESTION]], GREEDY)[
        0
    ]
    assert again.metrics.segment_hit_tokens == len(DOCS[0]) + len(DOCS[1]) + len(DOCS[2])


def test_a_segment_that_starts_like_a_cached_one_is_still_stored(model_dir: Path) -> None:
    llm = _llm(model_dir, prefix_cache="radix", repair="boundary")
    first, second = [7, *DOCS[0][1:]], [7, *DOCS[1][1:]]
    llm.generate([[SYSTEM, Segment(first), QUESTION]], GREEDY)
    # Under segment keys the cached path matches the first token of the new segment too (same token,
    # same place); the hit ends inside it.
    out = llm.generate([[SYSTEM, Segment(second), QUESTION]], GREEDY)[0]
    assert out.metrics.prefix_hit_tokens == len(SYSTEM) + 1
    # The segment is stored all the same: elsewhere, a later request splices all of it.
    again = llm.generate([[[4], Segment(second), QUESTION]], GREEDY)[0]
    assert again.metrics.segment_hit_tokens == len(second)


def test_exact_prefix_and_segments_work_together(model_dir: Path) -> None:
    llm = _llm(model_dir, prefix_cache="radix", repair="full")
    reference = _llm(model_dir, prefix_cache="off")
    # Documents into the segment store, under a prefix no later request shares.
    llm.generate([[[3], *(Segment(d) for d in DOCS), [5]]], GREEDY)
    # A cached prefix that ends 10 tokens into DOCS[1]; then the same prefix with documents after it:
    # the prefix is exact, the rest of DOCS[1] and DOCS[3] are spliced.
    first = llm.generate([[SYSTEM, DOCS[0], DOCS[1][:10], [1, 2, 3]]], GREEDY)[0]
    assert first.metrics.segment_hit_tokens == 0
    out = llm.generate([[SYSTEM, DOCS[0], Segment(DOCS[1]), Segment(DOCS[3]), QUESTION]], GREEDY)[0]
    want = reference.generate([[SYSTEM, DOCS[0], DOCS[1], DOCS[3], QUESTION]], GREEDY)[0]
    m = out.metrics
    assert m.prefix_hit_tokens == len(SYSTEM) + len(DOCS[0]) + 10
    # The segment straddling the end of the cached prefix is spliced from its 11th token on.
    assert m.segment_hit_tokens == len(DOCS[1]) - 10 + len(DOCS[3])
    torch.testing.assert_close(out.first_logits, want.first_logits, atol=1e-4, rtol=1e-4)


def test_approximate_kv_never_enters_the_prefix_cache(model_dir: Path) -> None:
    llm = _llm(model_dir, prefix_cache="radix", repair="none")
    _warm(llm)
    spliced = llm.generate([_parts([1, 0])], GREEDY)[0]
    assert spliced.metrics.segment_hit_tokens > 0
    plain = llm.generate([_parts([1, 0], segments=False)], GREEDY)[0]
    # Only the system prompt before the first spliced segment was exact, hence cached.
    assert plain.metrics.prefix_hit_tokens == len(SYSTEM)


def test_cache_salt_isolates_segments(model_dir: Path) -> None:
    llm = _llm(model_dir, prefix_cache="off")
    llm.generate([_parts([0, 1])], GREEDY, RequestOptions(cache_salt="a"))
    other = llm.generate([_parts([1, 0])], GREEDY, RequestOptions(cache_salt="b"))[0]
    same = llm.generate([_parts([1, 0])], GREEDY, RequestOptions(cache_salt="a"))[0]
    assert other.metrics.segment_hit_tokens == 0
    assert same.metrics.segment_hit_tokens == len(DOCS[0]) + len(DOCS[1])


def test_segment_store_is_evicted_under_the_budget_and_stays_correct(model_dir: Path) -> None:
    cfg = tiny_models.COMMON
    block_bytes = cfg["num_hidden_layers"] * 2 * 8 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    # 30 blocks of 8 tokens: one request and a few stored segments at most.
    llm = _llm(model_dir, prefix_cache="radix", repair="full", kv_cache_gb=30 * block_bytes / 2**30)
    reference = _llm(model_dir, prefix_cache="off")
    for order in ([0, 1], [2, 3], [1, 2], [3, 0], [0, 2]):
        got = llm.generate([_parts(order)], GREEDY)[0]
        want = reference.generate([_parts(order, segments=False)], GREEDY)[0]
        torch.testing.assert_close(got.first_logits, want.first_logits, atol=1e-4, rtol=1e-4)
        llm.engine.pool.allocator.check_invariants()
    assert llm.engine.segment_store.stats.evictions > 0


@pytest.mark.parametrize(
    "spec",
    [
        RopeSpec(10000.0),
        RopeSpec(1_000_000.0),
        RopeSpec(10000.0, (("rope_type", "linear"), ("factor", 8.0))),
        RopeSpec(
            500000.0,
            (
                ("rope_type", "llama3"),
                ("factor", 8.0),
                ("low_freq_factor", 1.0),
                ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", 8192),
            ),
        ),
    ],
)
def test_moving_keys_equals_encoding_them_at_the_new_position(spec: RopeSpec) -> None:
    freq = rope.inv_freq(spec, 64)
    keys = torch.randn(50, 2, 64, generator=torch.Generator().manual_seed(0))
    old = torch.randint(0, 5000, (50,))
    new = torch.randint(0, 5000, (50,))
    at_old = rope.apply(keys[None], *(t[None] for t in rope.cos_sin(old, freq)))[0]
    at_new = rope.apply(keys[None], *(t[None] for t in rope.cos_sin(new, freq)))[0]
    # float32 angles at positions of a few thousand carry ~1e-3 rad of rounding either way.
    torch.testing.assert_close(rope.rotate_by(at_old, new - old, freq), at_new, atol=5e-3, rtol=0)


def test_moved_first_layer_keys_equal_keys_computed_at_the_new_positions(model_dir: Path) -> None:
    """First-layer keys depend only on the token and its position, so a spliced segment's moved
    keys must equal those of a full prefill at the new positions, layer type by layer type."""
    llm = _llm(model_dir, prefix_cache="off", repair="none")
    _warm(llm)
    engine = llm.engine
    captured = {}
    place = engine.reuse._place

    def spy(table, spans, sources):
        place(table, spans, sources)
        for span in spans:
            captured[span.start] = engine.pool.slots(table, torch.arange(span.start, span.end))

    engine.reuse._place = spy
    llm.generate([_parts([2, 0])], SamplingParams(max_tokens=1))
    moved = {start: engine.pool.k[0, slots].clone() for start, slots in captured.items()}
    table = engine.pool.allocator.allocate(20)
    tokens = [*SYSTEM, *DOCS[2], *DOCS[0], *QUESTION]
    engine.runner.prefill(table, tokens, list(range(len(tokens))))
    for start, keys in moved.items():
        direct = engine.pool.k[0, engine.pool.slots(table, torch.arange(start, start + len(keys)))]
        torch.testing.assert_close(keys, direct, atol=1e-4, rtol=1e-4)
    assert len(moved) == 2


def test_prompt_segments_are_kept_from_the_request_that_computed_them(model_dir: Path) -> None:
    """The store keeps the KV the first request computed (no token computed twice),
    moved to the canonical positions: its first-layer keys equal keys computed there directly."""
    llm = _llm(model_dir, prefix_cache="off", repair="none")
    engine = llm.engine
    engine.add_request([SYSTEM, Segment(DOCS[1]), QUESTION], SamplingParams(max_tokens=1))
    first = engine.step()
    # The first token goes out before any store work: the copy runs at the start of the next step.
    assert first[0].output is not None and len(engine.segment_store) == 0 and engine.has_unfinished()
    assert engine.step() == [] and not engine.has_unfinished()
    assert len(engine.segment_store) == 1 and engine.segment_store.stats.inserted_tokens == len(DOCS[1])
    assert first[0].output.metrics.computed_tokens == len(SYSTEM) + len(DOCS[1]) + len(QUESTION)
    entry = engine.segment_store.lookup((str(engine.model_dir), None), tuple(DOCS[1]))
    assert entry is not None
    start = engine.segment_store.start_position
    stored = engine.pool.k[0, engine.pool.slots(entry.blocks, torch.arange(len(DOCS[1])))]
    tokens = [*([0] * start), *DOCS[1]]
    table = engine.pool.allocator.allocate(-(-len(tokens) // engine.pool.block_size))
    engine.runner.prefill(table, tokens, list(range(len(tokens))))
    direct = engine.pool.k[0, engine.pool.slots(table, torch.arange(start, start + len(DOCS[1])))]
    torch.testing.assert_close(stored, direct, atol=1e-4, rtol=1e-4)
    again = llm.generate([[SYSTEM, Segment(DOCS[1]), QUESTION]], SamplingParams(max_tokens=1))[0]
    assert again.metrics.segment_hit_tokens == len(DOCS[1])


def test_a_request_admitted_before_the_copy_moves_the_kv_from_where_it_was_computed(model_dir: Path) -> None:
    """The copy into the store is background work: a request that arrives right after a cold one is
    prepared first, splicing the segments from the cold request's blocks (held for the copy), and gets
    what it would get from the store: the same output as on an engine that had done the copy."""
    cold = [SYSTEM, Segment(DOCS[0]), Segment(DOCS[1]), QUESTION]
    warm = [SYSTEM, Segment(DOCS[1]), Segment(DOCS[0]), QUESTION]
    params = SamplingParams(max_tokens=3, temperature=0.0, return_first_logits=True)
    idle = _llm(model_dir, prefix_cache="off")
    idle.generate([cold], SamplingParams(max_tokens=1))
    while idle.engine.has_unfinished():
        idle.engine.step()
    assert len(idle.engine.segment_store) == 2
    want = idle.generate([warm], params)[0]

    # A step's budget (48 tokens) holds one of the two segments' copies, not both.
    llm = _llm(model_dir, prefix_cache="off", max_num_batched_tokens=48)
    engine = llm.engine
    engine.add_request(cold, SamplingParams(max_tokens=1))
    while not (first_step := engine.step()):
        pass
    (first,) = first_step
    assert first.output is not None and engine.background.holds_blocks
    engine.add_request(warm, params, request_id="next")
    # Admitted and prefilled (a probe pass, then the repair) before any copy: no step with a prefill in
    # it does background work.
    while not (outputs := engine.step()):
        assert len(engine.segment_store) == 0
    assert [o.request_id for o in outputs] == ["next"] and len(engine.segment_store) == 0
    # Served from the queued copies: hits for the store's counters (and /metrics), as after the copy.
    stats = engine.segment_store.stats
    assert (stats.lookups, stats.hits, stats.hit_tokens) == (4, 2, len(DOCS[0]) + len(DOCS[1]))
    done, stored = None, []
    while engine.has_unfinished():
        done = next((o.output for o in engine.step() if o.output is not None), done)
        stored.append(len(engine.segment_store))
    assert done is not None and not engine.background.holds_blocks
    steps = zip([0, *stored[:-1]], stored, strict=True)
    assert stored[-1] == 2 and all(b - a <= 1 for a, b in steps), "one segment's copy a step"
    assert done.metrics.segment_hit_tokens == want.metrics.segment_hit_tokens == len(DOCS[0]) + len(DOCS[1])
    assert done.first_logits is not None and want.first_logits is not None
    assert done.token_ids == want.token_ids
    assert done.first_logits is not None and want.first_logits is not None
    torch.testing.assert_close(done.first_logits, want.first_logits, atol=1e-4, rtol=1e-4)
    # Nothing is held but the store's copies (the prefix cache is off).
    bs = engine.pool.block_size
    assert engine.pool.allocator.num_used == sum(-(-len(d) // bs) for d in DOCS[:2])


def test_background_copies_go_one_segment_a_step_whatever_the_budget(model_dir: Path) -> None:
    """A request that arrives while background work runs waits for it to end: with a budget that has
    room for every copy, an idle step still copies one segment, so a newcomer waits for one copy at most."""
    llm = _llm(model_dir, prefix_cache="off", max_num_batched_tokens=4096)
    engine = llm.engine
    engine.add_request(
        [SYSTEM, Segment(DOCS[0]), Segment(DOCS[1]), Segment(DOCS[2]), QUESTION], SamplingParams(max_tokens=1)
    )
    while not engine.step():
        pass
    assert engine.background.holds_blocks and len(engine.segment_store) == 0
    sizes = []
    while engine.has_unfinished():
        engine.step()
        sizes.append(len(engine.segment_store))
    assert sizes == [1, 2, 3] and not engine.background.holds_blocks


def test_queued_copies_give_their_blocks_back_when_a_request_needs_the_memory(model_dir: Path) -> None:
    llm = _llm(model_dir, prefix_cache="off", kv_cache_gb=0.0007)
    engine = llm.engine
    capacity = engine.pool.num_blocks
    engine.add_request([SYSTEM, Segment(DOCS[2]), QUESTION], SamplingParams(max_tokens=1))
    engine.step()
    assert engine.background.holds_blocks
    # A request that needs nearly the whole pool: admitted only once the copy has given the blocks back.
    long = [7] * ((capacity - 4) * engine.pool.block_size - 2)
    engine.add_request(long, SamplingParams(max_tokens=1), request_id="long")
    assert engine.pool.allocator.num_free < capacity - 4
    engine.step()
    assert not engine.background.holds_blocks and [r.request_id for r in engine.scheduler.running] == ["long"]


def test_the_segment_shift_is_the_model_familys(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3 repairs with the segment shift at 0.5 (held-out runs measured it closer to a full prefill
    there, and the Llama family further), other families without it."""
    family = 0.5 if model_dir.name.startswith("Gemma3") else 0.0
    engine = _llm(model_dir).engine
    assert engine.reuse.shift == family
    logits = {}
    for shift in (0.0, 0.5):
        # An engine each, so that no request reads another's spliced KV from the prefix cache; `boundary`
        # recomputes the first tokens of every segment, a sample of each to shift the rest by.
        monkeypatch.setitem(FAMILY_SHIFT, engine.model_config.architecture, shift)
        llm = _llm(model_dir, prefix_cache="radix", repair="boundary", recompute_ratio=0.3)
        assert llm.engine.reuse.shift == shift
        _warm(llm)
        out = llm.generate([_parts([3, 1, 0, 2])], GREEDY)[0]
        assert out.metrics.recomputed_tokens > 0
        logits[shift] = out.first_logits
    assert not torch.allclose(logits[0.0], logits[0.5], atol=1e-4), "the shift moves the logits"


def test_a_new_ratio_per_request_holds_bounded_memory(model_dir: Path) -> None:
    """A client that sends a different recompute_ratio with every request: each is a repair setting of
    its own in the segment keys, and the engine remembers at most MAX_SETTINGS of them, however many
    come. A forgotten setting that returns is keyed afresh: no earlier request's spliced KV is served
    under another setting's keys."""
    if not model_dir.name.startswith("Llama"):
        pytest.skip("one architecture suffices: the keys do not depend on it")
    from kvsplice.cache.segment_keys import MAX_SETTINGS

    llm = _llm(model_dir, prefix_cache="radix", repair="boundary")
    _warm(llm)
    keys = llm.engine.blocks.segment_keys
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(1000):
        out = llm.generate([_parts([i % 4, (i + 1) % 4])], one, RequestOptions(recompute_ratio=i / 1000))[0]
        assert out.metrics.segment_hit_tokens + out.metrics.prefix_hit_tokens > len(SYSTEM)
        assert keys.num_settings <= MAX_SETTINGS
    assert keys.num_settings == MAX_SETTINGS
    # The first ratio was forgotten long ago: its own earlier request is not a prefix hit now.
    again = llm.generate([_parts([0, 1])], one, RequestOptions(recompute_ratio=0.0))[0]
    assert again.metrics.prefix_hit_tokens == len(SYSTEM)
