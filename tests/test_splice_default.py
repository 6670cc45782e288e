"""Splicing on the default model (Gemma 3 270M): exact where it must be, and the repair policies ordered
as measured. Synthetic documents, so the test needs no data set."""

from __future__ import annotations

import pytest
import torch

from kvsplice import LLM, SamplingParams, Segment
from kvsplice.options import RequestOptions
from kvsplice.repair import adaptive

pytestmark = pytest.mark.slow

DOCS = [
    "The Larkspur Observatory\nThe Larkspur Observatory stands on a ridge above the town of Emmerich. "
    + "It was founded by a society of amateur astronomers who pooled their savings to buy a telescope. " * 6,
    "River Transport in the Valley\nBarges carried timber and ore down the Velde river for two centuries. "
    + "Each barge was towed by horses walking along a path beside the water. " * 7,
    "The Guild of Clockmakers\nThe clockmakers of Aubel formed a guild to set prices and train apprentices. "
    + "An apprentice served seven years before presenting a finished clock to the masters. " * 6,
]
QUESTION = "Question: Who founded the Larkspur Observatory?\nAnswer:"
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, return_first_logits=True)


def _prompt(order: list[int], segments: bool = True) -> list:
    return [
        "Answer from the documents.\n\n",
        *(Segment(DOCS[i]) if segments else DOCS[i] for i in order),
        QUESTION,
    ]


@pytest.fixture(scope="module")
def spliced(default_model_dir) -> LLM:
    llm = LLM(prefix_cache="radix", kv_cache_gb=0.5)
    llm.generate([_prompt([0, 1, 2])], PARAMS)
    return llm


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(torch.sum(p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))))


def test_canonical_context_is_longer_than_the_window_and_block_aligned(spliced: LLM) -> None:
    engine = spliced.engine
    context = engine.segment_store.context
    assert context[0] == spliced.tokenizer.bos_token_id
    assert len(context) > engine.model_config.sliding_window
    assert len(context) % engine.pool.block_size == 0


def test_full_repair_equals_the_full_prefill(spliced: LLM, llm: LLM) -> None:
    order = [2, 0, 1]
    got = spliced.generate([_prompt(order)], PARAMS, RequestOptions(repair="full"))[0]
    want = llm.generate([_prompt(order, segments=False)], PARAMS)[0]
    assert got.metrics.segment_hit_tokens > 0
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=2e-3, rtol=1e-3)
    assert got.token_ids == want.token_ids


def test_repair_brings_the_answer_distribution_closer(spliced: LLM, llm: LLM) -> None:
    order = [1, 2, 0]
    want = llm.generate([_prompt(order, segments=False)], PARAMS)[0].first_logits
    kl = {
        policy: _kl(
            want,
            spliced.generate([_prompt(order)], PARAMS, RequestOptions(repair=policy, recompute_ratio=0.3))[
                0
            ].first_logits,
        )
        for policy in ("none", "attention", "full")
    }
    assert kl["full"] < 1e-4 < kl["attention"] < kl["none"], kl


def test_adaptive_repair_at_target_zero_falls_back_to_the_full_prefill(
    spliced: LLM, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target no estimate can meet: the rounds run out at half the reused tokens, then every reused
    token is recomputed at once, which is a full prefill."""
    order = [2, 1, 0]
    monkeypatch.setattr(adaptive, "TARGET", 0.0)
    # adaptive takes no budget: a ratio of its own only keys this test's requests apart from the
    # others', so that none takes another's spliced KV as its prefix.
    options = RequestOptions(repair="adaptive", recompute_ratio=0.91)
    got = spliced.generate([_prompt(order)], PARAMS, options)[0]
    want = llm.generate([_prompt(order, segments=False)], PARAMS)[0]
    assert got.metrics.segment_hit_tokens > 0
    assert got.metrics.recomputed_tokens == got.metrics.segment_hit_tokens
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=2e-3, rtol=1e-3)
    assert got.token_ids == want.token_ids


def test_a_near_tie_after_repair_falls_back_to_the_full_prefill(spliced: LLM, llm: LLM) -> None:
    """Below the fallback margin, lead's repair is followed by one pass that recomputes every reused
    token with approximate KV: a full prefill's logits. Above it the repair is lead's alone."""
    order = [1, 0, 2]
    want = llm.generate([_prompt(order, segments=False)], PARAMS)[0]
    # The first request in this order leaves its first document's lead KV in the store, the second that
    # document's exact KV in the prefix cache; the ones compared after them see the same caches. Each
    # margin is a repair setting of its own, so no request reuses another's spliced prefix.
    for warm in (0.0, 1e-9):
        spliced.generate(
            [_prompt(order)], PARAMS, RequestOptions(repair="attention", repair_fallback_margin=warm)
        )
    options = RequestOptions(repair="attention", repair_fallback_margin=1e-8)
    lead = spliced.generate([_prompt(order)], PARAMS, options)[0]
    assert lead.first_logits is not None and not lead.metrics.repair_fallback
    top = lead.first_logits.softmax(-1).topk(2).values
    margin = float(top[0] - top[1])
    assert _kl(want.first_logits, lead.first_logits) > 1e-4, "lead alone is not exact here"
    sure = spliced.generate(
        [_prompt(order)], PARAMS, RequestOptions(repair="attention", repair_fallback_margin=margin / 2)
    )
    assert not sure[0].metrics.repair_fallback
    torch.testing.assert_close(sure[0].first_logits, lead.first_logits)
    (torn,) = spliced.generate(
        [_prompt(order)], PARAMS, RequestOptions(repair="attention", repair_fallback_margin=1.0)
    )
    m = torn.metrics
    assert m.repair_fallback and m.segment_hit_tokens > 0
    assert (
        m.recomputed_tokens == m.segment_hit_tokens - m.segment_lead_tokens > lead.metrics.recomputed_tokens
    )
    assert m.prefill_flops > lead.metrics.prefill_flops
    torch.testing.assert_close(torn.first_logits, want.first_logits, atol=2e-3, rtol=1e-3)
    assert torn.token_ids == want.token_ids


def test_adaptive_repair_spends_by_its_target(spliced: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    order = [0, 2, 1]
    spent = {}
    for target, ratio in ((1e9, 0.92), (0.0, 0.93)):
        monkeypatch.setattr(adaptive, "TARGET", target)
        # A ratio each (adaptive takes no budget): the same settings would take the first request's
        # spliced KV as the second's prefix.
        options = RequestOptions(repair="adaptive", recompute_ratio=ratio)
        spent[target] = spliced.generate([_prompt(order)], PARAMS, options)[0].metrics
    loose, strict = spent[1e9], spent[0.0]
    # A target every estimate meets stops after the first round: 15 % of the reused tokens, rounded up.
    assert loose.recomputed_tokens == -(-loose.segment_hit_tokens * 15 // 100)
    # Every reused token but those spliced from lead KV (exact already; none here: the first request
    # left the first document in the prefix cache).
    assert strict.recomputed_tokens == strict.segment_hit_tokens - strict.segment_lead_tokens
    assert loose.prefill_flops < strict.prefill_flops
