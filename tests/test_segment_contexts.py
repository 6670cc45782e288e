"""A stored segment's KV as the mean over several contexts (EngineConfig.segment_contexts).

On the default model: the stored KV equals the mean of KV computed directly, by a plain prefill of
each context followed by the segment; the contexts are background work after the first token. Without
a model: how a context is drawn from the store's other segments."""

from __future__ import annotations

import pytest
import torch

from kvsplice import LLM, SamplingParams, Segment
from kvsplice.cache.segments import SegmentStore
from kvsplice.kv import rope
from kvsplice.kv.allocator import BlockAllocator
from kvsplice.prompt import parse_prompt
from kvsplice.reuse import segment_kv
from kvsplice.reuse.segment_kv import ContextPiece, sample_context
from tests.test_store_support import segment_files

DOCS = [
    "The Larkspur Observatory\nThe Larkspur Observatory stands on a ridge above the town of Emmerich. "
    + "It was founded by a society of amateur astronomers who pooled their savings. " * 3,
    "River Transport in the Valley\nBarges carried timber and ore down the Velde river for two centuries. "
    + "Each barge was towed by horses walking along a path beside the water. " * 3,
]
ONE = SamplingParams(max_tokens=1, temperature=0.0)


def _prompt(doc: int) -> list:
    return ["Answer from the documents.\n\n", Segment(DOCS[doc]), "Question: Who founded it?\nAnswer:"]


def _kv(llm: LLM, tokens: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [layers, end - start, kv_heads, head_dim] of tokens start..end in a plain prefill of `tokens`."""
    engine = llm.engine
    table = engine.pool.allocator.allocate(-(-len(tokens) // engine.pool.block_size))
    engine.runner.prefill(table, tokens, list(range(len(tokens))))
    slots = engine.pool.slots(table, torch.arange(start, end))
    k, v = engine.pool.k[:, slots].clone(), engine.pool.v[:, slots].clone()
    engine.pool.allocator.decref(reversed(table))
    return k, v


def _in_place(llm: LLM, doc: int) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
    """The document's tokens and its KV where the prompt carries it, keys moved to the store's
    canonical positions (what the store keeps from the request that computed it)."""
    engine = llm.engine
    parsed = parse_prompt(_prompt(doc), llm.tokenizer, engine.model_config.vocab_size)
    span = parsed.segments[0]
    k, v = _kv(llm, list(parsed.token_ids), span.start, span.end)
    cfg, shift = engine.model_config, engine.segment_store.start_position - span.start
    delta = torch.full((span.end - span.start,), shift)
    k = torch.stack(
        [rope.rotate_by(k[i], delta, engine.runner.freqs[t]) for i, t in enumerate(cfg.layer_types)]
    )
    return parsed.segment_tokens(span), k, v


def _stored(llm: LLM, tokens: tuple[int, ...]) -> tuple[int, torch.Tensor, torch.Tensor]:
    engine = llm.engine
    entry = engine.segment_store.peek((str(engine.model_dir), None), tokens)
    assert entry is not None
    slots = engine.pool.slots(entry.blocks, torch.arange(len(tokens)))
    return entry.contexts, engine.pool.k[:, slots], engine.pool.v[:, slots]


@pytest.mark.slow
def test_stored_kv_is_the_mean_over_its_contexts(default_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segment_kv, "CONTEXTS", 3)
    # No trust gate: its calibration audits would be background work beside the samples counted here.
    llm = LLM(prefix_cache="off", auto_segments=False, repair="none", kv_cache_gb=0.3, fidelity_target=0.0)
    engine, store = llm.engine, llm.engine.segment_store
    context = store.context
    engine.add_request(_prompt(0), ONE)
    first = engine.step()
    # The first token goes out before any store work; the copy follows, as background.
    assert first[0].output is not None and len(store) == 0
    while engine.has_unfinished():
        assert engine.step() == []
    tokens0, k_prompt, v_prompt = _in_place(llm, 0)
    # Seen once, the document costs its in-place prefill: stored with that KV, nothing computed after.
    assert _stored(llm, tokens0)[0] == 1 and store.stats.sampled_tokens == 0
    assert engine.stats().background_tokens == 0
    # Seen again, it is computed after two more contexts, as background work after that request.
    llm.generate([_prompt(0)], ONE)
    while engine.has_unfinished():
        engine.step()
    # The first document has no other segment to draw a context from: both extra contexts are the
    # canonical one, whose KV is computed once and moved in.
    k_canon, v_canon = _kv(llm, [*context, *tokens0], len(context), len(context) + len(tokens0))
    contexts, k, v = _stored(llm, tokens0)
    assert contexts == 3
    torch.testing.assert_close(k, (k_prompt + 2 * k_canon) / 3, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, (v_prompt + 2 * v_canon) / 3, atol=1e-4, rtol=1e-4)
    assert store.stats.sampled_tokens == len(context) + 2 * len(tokens0)
    assert store.context_blocks is not None
    # Not the single context's KV: the mean moved it.
    assert (k - k_prompt).abs().max() > 1e-2

    for _ in range(2):
        llm.generate([_prompt(1)], ONE)
        while engine.has_unfinished():
            engine.step()
    tokens1, k_prompt, v_prompt = _in_place(llm, 1)
    # The second document's contexts end with the first document, the only other segment held, whose
    # stored KV (the mean above) is moved there; the canonical text before it is the canonical
    # context's start, moved from its KV; only the document is computed.
    k_other, v_other = _after_stored(llm, tokens0, k, v, tokens1)
    contexts, k1, v1 = _stored(llm, tokens1)
    assert contexts == 3
    torch.testing.assert_close(k1, (k_prompt + 2 * k_other) / 3, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v1, (v_prompt + 2 * v_other) / 3, atol=1e-4, rtol=1e-4)
    # Computed for the second document: itself, twice.
    assert store.stats.sampled_tokens == len(context) + 2 * len(tokens0) + 2 * len(tokens1)
    # Every background token is counted: the samples are all the background work there was here.
    assert engine.stats().background_tokens == store.stats.sampled_tokens


def _after_stored(
    llm: LLM, other: tuple[int, ...], k: torch.Tensor, v: torch.Tensor, tokens: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of `tokens` computed after the canonical context's start and `other`, whose KV is `k`, `v`
    at the canonical positions, moved to where it is in that sequence."""
    engine = llm.engine
    context = engine.segment_store.context
    head = list(context[: len(context) - len(other)])
    sequence = [*head, *other, *tokens]
    table = engine.pool.allocator.allocate(-(-len(sequence) // engine.pool.block_size))
    engine.runner.prefill(table, head, list(range(len(head))))
    here = torch.arange(len(head), len(head) + len(other))
    shift = torch.full((len(other),), len(head) - len(context))
    slots = engine.pool.slots(table, here)
    for layer, kind in enumerate(engine.model_config.layer_types):
        moved = rope.rotate_by(k[layer], shift, engine.runner.freqs[kind])
        engine.pool.write(layer, slots, moved, v[layer])
    start = len(head) + len(other)
    positions = list(range(start, len(sequence)))
    engine.runner.prefill(table, sequence, positions)
    out = engine.pool.slots(table, torch.tensor(positions))
    result = engine.pool.k[:, out].clone(), engine.pool.v[:, out].clone()
    engine.pool.allocator.decref(reversed(table))
    return result


def _store(context: tuple[int, ...], segments: list[tuple[int, ...]]) -> SegmentStore:
    allocator = BlockAllocator(64, 4)
    store = SegmentStore(allocator, context)
    for tokens in segments:
        store.insert("ns", tokens, allocator.allocate(-(-len(tokens) // 4)))
    return store


def test_a_context_is_as_long_as_the_canonical_one_and_ends_with_other_segments() -> None:
    context = tuple(range(900, 912))  # 12 tokens, BOS first
    segments = [tuple(range(100 * i, 100 * i + 5)) for i in range(1, 7)]
    store = _store(context, segments)
    own = segments[0]
    drawn = [sample_context(store, "ns", own, index) for index in range(1, 9)]
    for pieces in drawn:
        assert pieces[0] == ContextPiece(context[:1], canonical=True)
        assert sum(len(p.tokens) for p in pieces) == len(context)
        # Then only other segments' ends, moved from the store; only the first may be cut.
        rest = pieces[1:]
        assert all(p.source in segments[1:] for p in rest)
        assert all(p.tokens == p.source[p.offset :] for p in rest if p.source is not None)
        assert all(p.offset == 0 for p in rest[1:]) and len({p.source for p in rest}) == len(rest)
    # Deterministic, and the draws differ from one context to the next.
    assert drawn == [sample_context(store, "ns", own, index) for index in range(1, 9)]
    assert len({tuple(p.source for p in pieces) for pieces in drawn}) > 1
    # Another namespace has no other segments: the canonical context itself.
    assert sample_context(store, "other", own, 1) == [ContextPiece(context, canonical=True)]


def test_with_few_other_segments_the_canonical_context_starts_it() -> None:
    context = tuple(range(900, 912))
    store = _store(context, [(1, 2, 3), (4, 5, 6, 7)])
    # A prefix of the canonical context, at its own positions: its KV is the canonical context's.
    assert sample_context(store, "ns", (1, 2, 3), 1) == [
        ContextPiece(context[:8], canonical=True),
        ContextPiece((4, 5, 6, 7), (4, 5, 6, 7), 0),
    ]
    assert sample_context(_store((), [(1, 2)]), "ns", (1, 2), 1) == []


@pytest.mark.parametrize(
    "window, positions, expected",
    [
        (None, 32768, 1024),  # no sliding window (SmolLM2)
        (512, 32768, 1024),  # Gemma 3: its window + 64 is less
        (4096, 32768, 4160),  # a long window: a full window of context, and 64 more
        (4100, 32768, 4176),  # rounded up to whole blocks
        (None, 1024, 512),  # at most half the model's positions
    ],
)
def test_canonical_context_length(window: int | None, positions: int, expected: int) -> None:
    from kvsplice.cache.segments import canonical_context_length
    from kvsplice.model_config import ModelConfig
    from tests.tiny_models import COMMON

    cfg = ModelConfig.from_dict(
        {
            **COMMON,
            "architectures": ["LlamaForCausalLM"],
            "rope_theta": 10000.0,
            "max_position_embeddings": positions,
            **({"sliding_window": window} if window else {}),
        }
    )
    assert cfg.sliding_window == window
    assert canonical_context_length(cfg, 16) == expected


@pytest.mark.slow
def test_closing_before_the_contexts_still_writes_the_segment(default_model_dir, tmp_path) -> None:
    """A segment goes to the tiers below once its last context is folded in; closed before that, it
    goes with the contexts it has, rather than never."""
    llm = LLM(prefix_cache="off", auto_segments=False, store={"store_dir": str(tmp_path)}, kv_cache_gb=0.3)
    assert segment_kv.CONTEXTS == 4
    llm.generate([_prompt(0)], ONE)
    assert llm.engine.background.busy
    llm.close()
    assert len(segment_files(tmp_path)) == 1
