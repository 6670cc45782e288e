"""Quality work only where reuse pays it back (engine/background.py), on the default model.

A document seen once costs its in-place prefill: the engine's whole compute (requests' prefills plus
every background token, drained) stays within 1.15 prefills of the prompts, against a plain engine's
full prefills of the same prompts. Seen again, it is computed after more contexts. A document that
opened its first prompt has its lead KV copied from there: equal to computing it again.
"""

from __future__ import annotations

import pytest
import torch

from kvsplice import LLM, SamplingParams, Segment
from kvsplice.bench import corpus
from kvsplice.reuse import segment_kv

ONE = SamplingParams(max_tokens=1, temperature=0.0)
HEAD = "Answer from the documents.\n\n"
QUESTION = "Question: Which of these places is the oldest?\nAnswer:"


def _docs(n: int) -> list[str]:
    return [p.text for p in corpus.load("synthetic").passages[:n]]


def _drain(llm: LLM) -> None:
    while llm.engine.has_unfinished():
        llm.engine.step()


@pytest.mark.slow
def test_documents_seen_once_cost_one_prefill_and_seen_again_get_their_contexts(default_model_dir) -> None:
    docs = _docs(24)
    # Four cold requests of six new documents each: what a stream of novel RAG traffic looks like. The
    # store's own work only: the trust gate's calibration audits (test_trust_gate.py) are off.
    llm = LLM(kv_cache_gb=1.0, num_threads=1, fidelity_target=0.0)
    plain = LLM(prefix_cache="off", auto_segments=False, kv_cache_gb=1.0, num_threads=1)
    prompt_tokens = 0
    for i in range(4):
        cold = docs[6 * i : 6 * i + 6]
        prompt_tokens += llm.generate([[HEAD, *map(Segment, cold), QUESTION]], ONE)[0].metrics.prompt_tokens
        _drain(llm)
        plain.generate([[HEAD, *cold, QUESTION]], ONE)
    spent, full = llm.engine.stats(), plain.engine.stats()
    assert spent.background_queued == 0 and spent.background_tokens == 0
    assert spent.prefill_tokens + spent.background_tokens <= 1.15 * prompt_tokens
    assert spent.prefill_flops + spent.background_flops <= 1.15 * full.prefill_flops
    # Every document was stored, each with the KV its prompt computed; those that opened a prompt also
    # with their lead KV, copied from there (nothing computed for it).
    assert spent.segment_entries == 24 and spent.segment_lead_tokens == 0
    entries = llm.engine.segment_store._entries.values()
    assert all(e.contexts == 1 for e in entries)
    assert sum(e.lead_blocks is not None for e in entries) == 4

    # Two documents seen again: computed after CONTEXTS - 1 more contexts each, as background work.
    llm.generate([[HEAD, Segment(docs[7]), Segment(docs[1]), QUESTION]], ONE)
    _drain(llm)
    again = llm.engine.stats()
    ns = (str(llm.engine.model_dir), None)
    for text in (docs[7], docs[1]):
        tokens = tuple(llm.tokenizer.encode(text))
        entry = llm.engine.segment_store.peek(ns, tokens)
        assert entry is not None and entry.contexts == segment_kv.CONTEXTS
    assert again.background_tokens > 0 and again.background_tokens == again.segment_sampled_tokens + (
        again.segment_lead_tokens
    )
    llm.close()


@pytest.mark.slow
def test_lead_kv_copied_from_the_prompt_equals_lead_kv_computed(default_model_dir) -> None:
    doc = _docs(1)[0]
    llm = LLM(prefix_cache="off", auto_segments=False, kv_cache_gb=0.5, num_threads=1)
    out = llm.generate([[HEAD, Segment(doc), QUESTION]], ONE)[0]
    _drain(llm)
    engine = llm.engine
    tokens = tuple(llm.tokenizer.encode(doc))
    entry = engine.segment_store.peek((str(engine.model_dir), None), tokens)
    assert entry is not None and entry.lead_blocks is not None
    head = entry.lead_head
    assert head == tuple(out.prompt_token_ids[: len(head)])
    assert engine.stats().segment_lead_tokens == 0, "copied, not computed"
    # The reference: the head and the document computed from position 0 in fresh blocks.
    sequence = [*head, *tokens]
    table = engine.pool.allocator.allocate(-(-len(sequence) // engine.pool.block_size))
    engine.runner.prefill(table, sequence, list(range(len(sequence))))
    every = torch.arange(len(sequence))
    want_k, want_v = (
        engine.pool.k[:, engine.pool.slots(table, every)],
        engine.pool.v[:, engine.pool.slots(table, every)],
    )
    got = engine.pool.slots(entry.lead_blocks, every)
    torch.testing.assert_close(engine.pool.k[:, got], want_k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(engine.pool.v[:, got], want_v, atol=1e-4, rtol=1e-4)
    engine.pool.allocator.decref(reversed(table))
    llm.close()
