"""Lead KV (reuse/segment_kv.LEAD_KV): each stored segment's KV computed at a prompt's start, spliced
where a prompt starts with the segment. On the default model, against plain prefills; without a model,
the store gives the lead blocks back with the entry."""

from __future__ import annotations

import pytest
import torch

from kvsplice import LLM, RequestOptions, SamplingParams, Segment
from kvsplice.cache.segments import SegmentEntry, SegmentStore
from kvsplice.kv.allocator import BlockAllocator
from kvsplice.reuse import segment_kv
from kvsplice.reuse.path import LEAD_HEAD_TOKENS

DOC_A = (
    "The Larkspur Observatory\nThe Larkspur Observatory stands on a ridge above the town of Emmerich. "
    + ("It was founded by a society of amateur astronomers who pooled their savings to buy a telescope. " * 4)
)
DOC_B = (
    "River Transport in the Valley\nBarges carried timber and ore down the Velde river for two centuries. "
    + ("Each barge was towed by horses walking along a path beside the water. " * 4)
)
QUESTION = "Question: Who founded the Larkspur Observatory?\nAnswer:"
HEAD = "Answer from the documents.\n\n"
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, return_first_logits=True)
# Longer than LEAD_HEAD_TOKENS: a segment after it is spliced from its mean KV.
LONG_HEAD = "Read the documents below with care, then answer the question that follows them. " * 6


def _warm(**config: object) -> LLM:
    """An engine whose store holds both documents, stored from a prompt that starts with HEAD, then
    DOC_B: DOC_A's stored KV saw DOC_B before it. Both have their lead KV after HEAD: DOC_B's copied
    from that prompt, which it opened; DOC_A's computed once a second prompt opens with it (under other
    repair settings, so that the prefix cache keeps that prompt's KV of DOC_A under keys no later
    request here matches)."""
    llm = LLM(prefix_cache="radix", auto_segments=False, repair="none", kv_cache_gb=0.5, **config)
    for prompt, options in (
        ([HEAD, Segment(DOC_B), Segment(DOC_A), QUESTION], None),
        ([HEAD, Segment(DOC_A), "Question: What is it?\nAnswer:"], RequestOptions(repair="boundary")),
    ):
        llm.generate([prompt], PARAMS, options)
        while llm.engine.has_unfinished():  # the store work, after the request
            llm.engine.step()
    return llm


def _drop_doc_a_lead(llm: LLM) -> SegmentEntry:
    """Both documents used, DOC_A first, then one reclaim: DOC_A's lead KV, the least recently used (a
    lookup touches an entry's lead KV just before the entry), goes; both entries stay."""
    store = llm.engine.segment_store
    doc_b, doc_a = (store.peek(*key) for key in list(store._entries))  # the warm prompt had DOC_B first
    assert doc_a is not None and doc_b is not None
    assert llm.tokenizer.decode(list(doc_a.key[1])) == DOC_A
    store.lookup(*doc_a.key)
    store.lookup(*doc_b.key)
    store.reclaim_one()
    assert doc_a.lead_blocks is None and doc_b.lead_blocks is not None
    assert len(store) == 2 and store.stats.lead_evictions == 1 and store.stats.evictions == 0
    return doc_a


@pytest.fixture(scope="module")
def lead(default_model_dir) -> LLM:
    return _warm()


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(torch.sum(p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))))


@pytest.mark.slow
def test_a_prompt_that_starts_with_a_segment_is_spliced_exactly(lead: LLM, llm: LLM) -> None:
    store = lead.engine.segment_store
    # BOS, then the head's own tokens.
    head = (lead.tokenizer.bos_token_id, *lead.tokenizer.encode(HEAD))
    assert all(entry.lead_head == head for entry in store._entries.values())
    before = store.stats.lead_hit_tokens
    # The same head, then the document: its lead KV is what a full prefill computes there, so without
    # any repair the answer's distribution is the full prefill's.
    got = lead.generate([[HEAD, Segment(DOC_A), QUESTION]], PARAMS)[0]
    want = llm.generate([[HEAD, DOC_A, QUESTION]], PARAMS)[0]
    assert got.metrics.segment_hit_tokens > 0
    assert store.stats.lead_hit_tokens - before == got.metrics.segment_hit_tokens
    assert got.metrics.segment_lead_tokens == got.metrics.segment_hit_tokens
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=2e-3, rtol=1e-3)
    assert got.token_ids == want.token_ids

    # After another short head (BOS alone) the lead KV is off by the head it missed; still much
    # closer than the mean KV, which saw 1,024 tokens of other content (an engine without lead KV).
    prompt = [Segment(DOC_A), QUESTION]
    full = llm.generate([[DOC_A, QUESTION]], PARAMS)[0].first_logits
    other_head = lead.generate([prompt], PARAMS)[0]
    with_lead = _kl(full, other_head.first_logits)
    assert store.stats.lead_hit_tokens > before + got.metrics.segment_hit_tokens
    # Spliced from lead KV, but not a full prefill's: not counted as exact.
    assert other_head.metrics.segment_hit_tokens > 0 and other_head.metrics.segment_lead_tokens == 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(segment_kv, "LEAD_KV", False)
        without = _warm()
    assert not any(e.lead_blocks for e in without.engine.segment_store._entries.values())
    mean_kv = _kl(full, without.generate([prompt], PARAMS)[0].first_logits)
    assert with_lead < mean_kv / 2, (with_lead, mean_kv)


@pytest.mark.slow
def test_a_segment_after_a_long_head_is_spliced_from_its_mean_kv(lead: LLM) -> None:
    store = lead.engine.segment_store
    assert len(lead.tokenizer.encode(LONG_HEAD)) > LEAD_HEAD_TOKENS
    before = store.stats.lead_hit_tokens
    out = lead.generate([[LONG_HEAD, Segment(DOC_A), QUESTION]], PARAMS)[0]
    assert out.metrics.segment_hit_tokens > 0 and out.metrics.segment_lead_tokens == 0
    assert store.stats.lead_hit_tokens == before


def test_an_evicted_entry_gives_its_lead_blocks_back() -> None:
    allocator = BlockAllocator(16, 4)
    store = SegmentStore(allocator, ())
    store.insert("ns", (1, 2, 3, 4, 5), allocator.allocate(2))
    entry = store.peek("ns", (1, 2, 3, 4, 5))
    assert entry is not None
    store.attach_lead(entry, allocator.allocate(2), (9,))
    assert allocator.num_free == 12
    store.clear()
    assert allocator.num_free == 16 and len(store) == 0
    allocator.check_invariants()


A, B = (1, 2, 3, 4, 5), (6, 7, 8, 9, 10)


def _store_with_leads() -> tuple[BlockAllocator, SegmentStore]:
    """A store (10 blocks of 4 tokens) holding A and B, 2 blocks each, each with 2 blocks of lead KV
    attached after it was inserted: 8 blocks held, 2 free; A's lead KV is older than B."""
    allocator = BlockAllocator(10, 4)
    store = SegmentStore(allocator, ())
    for tokens in (A, B):
        store.insert("ns", tokens, allocator.allocate(2))
        entry = store.peek("ns", tokens)
        assert entry is not None
        store.attach_lead(entry, allocator.allocate(2), (0,))
    return allocator, store


def test_a_lead_kv_goes_before_its_entry() -> None:
    """Least recently used first, over entries and lead KVs alike; a lookup touches the entry's lead KV
    just before the entry: A's lead KV goes first, then A, while B keeps both."""
    allocator, store = _store_with_leads()
    store.lookup("ns", A)
    store.lookup("ns", B)
    allocator.allocate(4)  # 2 more than are free: one reclaim of 2 blocks
    a, b = store.peek("ns", A), store.peek("ns", B)
    assert a is not None and a.lead_blocks is None and a.lead_head == ()
    assert b is not None and b.lead_blocks is not None
    assert store.stats.lead_evictions == 1 and store.stats.evictions == 0
    allocator.allocate(2)
    assert store.peek("ns", A) is None and store.stats.evictions == 1
    b = store.peek("ns", B)
    assert b is not None and b.lead_blocks is not None
    allocator.check_invariants()


@pytest.mark.parametrize("at_start", [False, True])
def test_a_segment_reused_anywhere_keeps_its_lead_kv_over_an_older_entry(at_start: bool) -> None:
    """A reused inside a prompt (its lead KV not read) or at a prompt's start (read): B, older, goes whole
    first (its lead KV with it), and A keeps its lead KV, which a later prompt may open with."""
    allocator, store = _store_with_leads()
    a = store.lookup("ns", A)
    assert a is not None
    if at_start:
        store.lead_hit(a)
        assert store.stats.lead_hit_tokens == len(A)
    allocator.allocate(4)
    assert store.peek("ns", B) is None and store.stats.evictions == 1
    assert a.lead_blocks is not None and store.stats.lead_evictions == 0
    assert allocator.num_free == 2  # B's 4 blocks, 2 of them taken
    allocator.check_invariants()


@pytest.mark.slow
def test_a_dropped_lead_kv_is_computed_again_where_a_prompt_opens_with_it(default_model_dir) -> None:
    llm = _warm()
    # (DOC_A, unlike DOC_B, is not in the prefix cache after HEAD.)
    doc_a = _drop_doc_a_lead(llm)
    first = llm.generate([[HEAD, Segment(DOC_A), QUESTION]], PARAMS)[0]
    assert first.metrics.segment_hit_tokens > 0 and first.metrics.segment_lead_tokens == 0
    while llm.engine.has_unfinished():  # the lead KV, after this prompt's head
        llm.engine.step()
    assert doc_a.lead_blocks is not None
    # Other repair settings: the prefix cache does not hold this prompt's KV under their segment keys.
    again = llm.generate([[HEAD, Segment(DOC_A), QUESTION]], PARAMS, RequestOptions(repair="attention"))[0]
    assert again.metrics.segment_lead_tokens == again.metrics.segment_hit_tokens > 0
    llm.close()


@pytest.mark.slow
def test_prompts_admitted_together_queue_one_lead_fill(default_model_dir) -> None:
    llm = _warm()
    work = llm.engine.background
    doc_a = _drop_doc_a_lead(llm)
    # Both prompts open with DOC_A, so both prefills report its lead KV missing; one fill computes it.
    prompts = [[HEAD, Segment(DOC_A), q] for q in (QUESTION, "Question: Where is the observatory?\nAnswer:")]
    llm.generate(prompts, PARAMS)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert doc_a.lead_blocks is not None
    assert work.leads_dropped == 0
    llm.close()


@pytest.mark.slow
def test_a_segment_promoted_from_disk_gets_its_lead_kv(default_model_dir, tmp_path, llm: LLM) -> None:
    store_dir = str(tmp_path / "store")
    first = _warm(store={"store_dir": store_dir})
    first.close()
    # The tiers below hold the mean KV only: a fresh engine computes the lead KV after the promotion.
    fresh = LLM(
        prefix_cache="off",
        auto_segments=False,
        repair="none",
        kv_cache_gb=0.5,
        store={"store_dir": store_dir},
    )
    promoted = fresh.generate([[Segment(DOC_A), QUESTION]], PARAMS)[0]
    assert promoted.metrics.store_hit_tokens == {"disk": promoted.metrics.segment_hit_tokens}
    assert fresh.engine.segment_store.stats.lead_hit_tokens == 0
    while fresh.engine.has_unfinished():
        fresh.engine.step()
    got = fresh.generate([[Segment(DOC_A), QUESTION]], PARAMS)[0]
    assert fresh.engine.segment_store.stats.lead_hit_tokens == got.metrics.segment_hit_tokens > 0
    want = llm.generate([[DOC_A, QUESTION]], PARAMS)[0]
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=2e-3, rtol=1e-3)
    fresh.close()


@pytest.mark.slow
def test_a_segment_with_lead_kv_is_not_taken_from_an_earlier_prompts_approximate_kv(
    default_model_dir, llm: LLM
) -> None:
    llm_ = _warm()
    doc_a = _drop_doc_a_lead(llm_)
    # DOC_A opens this prompt without lead KV: spliced from its mean KV and repaired for this question,
    # then cached under segment keys.
    first = llm_.generate([[HEAD, Segment(DOC_A), Segment(DOC_B), QUESTION]], PARAMS)[0]
    assert first.metrics.segment_lead_tokens == 0 and first.metrics.segment_hit_tokens > 0
    while llm_.engine.has_unfinished():  # DOC_A's lead KV again
        llm_.engine.step()
    assert doc_a.lead_blocks is not None
    # Another question on DOC_A: spliced from the lead KV, not the first prompt's KV of DOC_A.
    other = [HEAD, Segment(DOC_A), "Question: On what does the observatory stand?\nAnswer:"]
    want = llm.generate([[HEAD, DOC_A, other[2]]], PARAMS)[0]
    got = llm_.generate([other], PARAMS)[0]
    assert got.metrics.segment_lead_tokens == got.metrics.segment_hit_tokens == len(doc_a.key[1])
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=2e-3, rtol=1e-3)
    # Its KV was exact: the prefix cache keeps it under plain ids, and the same prompt again is a hit.
    again = llm_.generate([other], PARAMS)[0]
    assert again.metrics.prefix_hit_tokens >= len(llm_.tokenizer.encode(HEAD)) + len(doc_a.key[1])
    torch.testing.assert_close(again.first_logits, want.first_logits, atol=2e-3, rtol=1e-3)
    llm_.close()
