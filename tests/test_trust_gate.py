"""The trust gate (repair/gate.py): its threshold against a brute-force oracle, its calibration, and the
engine's fallbacks under it against an independent full prefill. Tiny random-weight models, token-id
prompts."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsplice import LLM, RequestOptions, SamplingParams, Segment
from kvsplice.engine import gate_sync
from kvsplice.plan import make_plan
from kvsplice.repair.gate import (
    MAX_SAMPLES,
    MIN_SAMPLES,
    GateSample,
    Merged,
    TrustGate,
    prompt_shape,
    threshold,
)
from kvsplice.sampling import kl_divergence
from tests import tiny_models
from tests.test_store_support import RedisServer

rng = random.Random(11)
SYSTEM = [rng.randrange(1, 320) for _ in range(9)]
DOCS = [[rng.randrange(1, 320) for _ in range(40)] for _ in range(4)]
QUESTION = [rng.randrange(1, 320) for _ in range(6)]
FIRST = SamplingParams(max_tokens=1, temperature=0.0, return_first_logits=True)
# No prefix cache: each reordered prompt reuses its documents as segments, never an earlier prefix.
SETTINGS = {"block_size": 8, "kv_cache_gb": 0.01, "num_threads": 1, "prefix_cache": "off"}
# Unrepaired splicing: damage the gate can see on a random-weight model.
UNREPAIRED = RequestOptions(repair="none")
ORDERS = list(itertools.permutations(range(4)))


def _upper_bound(kl_kept: list[float]) -> float:
    return statistics.fmean(kl_kept) + 2.0 * statistics.stdev(kl_kept) / math.sqrt(len(kl_kept))


@given(
    st.lists(
        st.tuples(st.floats(0, 1), st.floats(0, 2)).map(lambda mk: GateSample(*mk)), min_size=2, max_size=40
    ),
    st.floats(1e-4, 0.5),
)
def test_the_threshold_is_the_lowest_margin_whose_kept_kl_meets_the_target(
    samples: list[GateSample], target: float
) -> None:
    def meets(t: float, slack: float) -> bool:
        return _upper_bound([s.kl if s.margin >= t else 0.0 for s in samples]) <= target + slack

    # A bound within rounding of the target (two ways of summing) may go either way: 1e-12 of slack.
    t = threshold(samples, target)
    candidates = sorted({0.0, *(s.margin for s in samples)})
    if t == math.inf:
        assert not any(meets(c, -1e-12) for c in candidates)
    else:
        assert t in candidates and meets(t, 1e-12)
        assert not any(meets(c, -1e-12) for c in candidates if c < t)


def test_a_shape_calibrates_then_falls_back_only_where_its_samples_say() -> None:
    gate = TrustGate(0.05)
    assert gate.wants_sample("a") and gate.margin("a") == 0.0
    for i in range(MIN_SAMPLES):
        gate.queued("a")
        assert gate.wants_sample("a") == (i + 1 < MIN_SAMPLES), "queued audits count toward calibration"
    for i in range(MIN_SAMPLES):
        assert gate.margin("a") == 0.0, "a calibrating shape is spliced"
        # Near-ties far from the full prefill; sure answers close to it.
        gate.add("a", GateSample(0.01 * i, 0.5) if i < 3 else GateSample(0.5 + 0.01 * i, 0.001), queued=True)
    assert gate.margin("a") == pytest.approx(0.53), "the near-ties fall back, the sure answers are spliced"
    # The cell splices 7 of its 10 samples' requests: it calibrates on until 10 of those.
    assert gate.wants_sample("a")
    for _ in range(3):
        gate.add("a", GateSample(0.9, 0.001), queued=False)
    assert not gate.wants_sample("a") and gate.margin("a") == pytest.approx(0.53)
    for _ in range(MIN_SAMPLES):
        gate.add("b", GateSample(0.9, 1.0), queued=False)
    assert gate.margin("b") == math.inf, "a shape whose sure answers are far from full is never spliced"
    assert gate.wants_sample("b"), "where every request falls back, each is a free sample"
    for _ in range(MIN_SAMPLES):
        gate.add("c", GateSample(0.1, 0.001), queued=False)
    assert gate.margin("c") == 0.0
    gate.fell_back("b", 120)
    cells = {c.key: c for c in gate.summary()}
    assert (
        cells["b"].fallbacks == 1 and cells["b"].fallback_tokens == 120 and cells["b"].threshold == math.inf
    )


def test_shapes_tell_few_short_examples_from_long_passages() -> None:
    short = make_plan(200, 0, [(10, 60, 0), (60, 110, 1), (110, 160, 2)])
    long = make_plan(2000, 0, [(0, 600, 0), (600, 1200, 1)], discovered=frozenset({1}))
    assert prompt_shape(short) == "2-4 x <128 marked"
    assert prompt_shape(long) == "2-4 x 512+ both"
    assert prompt_shape(make_plan(300, 0, [(0, 200, 0)], discovered=frozenset({0}))) == "1 x 128-511 found"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("LlamaForCausalLM")
    tiny_models.save("LlamaForCausalLM", directory)
    return directory


def _reordered(i: int) -> list[int]:
    """The i-th order of the four documents (distinct for i < 24)."""
    return list(ORDERS[i])


def _full(plain: LLM, order: list[int]) -> Any:
    """The same prompt without markup: a full prefill."""
    return plain.generate([[*SYSTEM, *(t for d in order for t in DOCS[d]), *QUESTION]], FIRST)[0]


def _ask(llm: LLM, order: list[int], options: RequestOptions) -> Any:
    out = llm.generate([[SYSTEM, *(Segment(DOCS[d]) for d in order), QUESTION]], FIRST, options)[0]
    while llm.engine.has_unfinished():  # the audits run as background work after the request
        llm.engine.step()
    return out


def test_a_shape_far_from_full_prefill_falls_back_to_a_full_prefill(model_dir: Path) -> None:
    # A target no unrepaired splice meets: once calibrated, every request of the shape falls back.
    gated = LLM(model=str(model_dir), fidelity_target=1e-9, audit_ratio=1.0, **SETTINGS)
    plain = LLM(
        model=str(model_dir), prefix_cache="off", **{k: v for k, v in SETTINGS.items() if k != "prefix_cache"}
    )
    _ask(gated, _reordered(0), UNREPAIRED)
    kls = []
    for i in range(MIN_SAMPLES):
        out = _ask(gated, _reordered(i + 1), UNREPAIRED)
        assert out.metrics.segment_hit_tokens > 0 and not out.metrics.repair_fallback, "calibrating"
        want = plain.generate(
            [[*SYSTEM, *(t for d in _reordered(i + 1) for t in DOCS[d]), *QUESTION]], FIRST
        )[0]
        kls.append(kl_divergence(want.first_logits, out.first_logits))
    assert max(kls) > 1e-4, "unrepaired splicing is not exact here: the gate has damage to see"
    (cell,) = gated.engine.stats().gate
    assert cell.samples == MIN_SAMPLES and cell.threshold == math.inf
    background = gated.engine.stats().background_tokens
    order = _reordered(MIN_SAMPLES + 1)
    out = _ask(gated, order, UNREPAIRED)
    assert out.metrics.repair_fallback
    want = _full(plain, order)
    assert kl_divergence(want.first_logits, out.first_logits) < 1e-6, "a fallback answers as a full prefill"
    stats = gated.engine.stats()
    (cell,) = stats.gate
    assert cell.fallbacks == 1 and cell.fallback_tokens > 0 and cell.samples == MIN_SAMPLES + 1
    assert stats.background_tokens == background, "a fallback's own full prefill is its audit: no more work"


def test_a_shape_within_the_target_is_spliced_after_calibration(model_dir: Path) -> None:
    lenient = LLM(model=str(model_dir), fidelity_target=100.0, audit_ratio=0.0, **SETTINGS)
    _ask(lenient, _reordered(0), UNREPAIRED)
    for i in range(MIN_SAMPLES + 2):
        out = _ask(lenient, _reordered(i + 1), UNREPAIRED)
        assert out.metrics.segment_hit_tokens > 0 and not out.metrics.repair_fallback
    (cell,) = lenient.engine.stats().gate
    assert cell.threshold == 0.0 and cell.fallbacks == 0
    # Calibration audits stop once the shape has its samples (audit_ratio 0: no scheduled ones).
    assert cell.samples == MIN_SAMPLES


def test_merged_samples_calibrate_a_new_gate_and_bad_data_is_ignored() -> None:
    gate = TrustGate(0.05)
    for i in range(MIN_SAMPLES):
        gate.add("a", GateSample(0.1 * i, 0.2 if i < 4 else 0.0), queued=False)
    again = TrustGate(0.05)
    assert again.merge(gate.to_bytes()) == Merged(MIN_SAMPLES, 0)
    assert again.summary() == gate.summary() and again.margin("a") == gate.margin("a") > 0
    assert again.merge(gate.to_bytes()) == Merged(0, 0), "a sample is taken once"
    bad = TrustGate(0.05)
    assert bad.merge(b'{"version": 2, "cells": {"a": [[0.5, -1.0, 1, 2]]}}') == Merged(0, 0)
    assert bad.summary() == (), "a negative KL is no sample: nothing is taken"
    assert bad.merge(b"{not json") == Merged(0, 0) and bad.summary() == ()


def test_two_gates_merge_into_the_same_samples_and_keep_the_most_recent() -> None:
    """Replicas' gates: each takes the other's samples once, both read one threshold from the union,
    and a cell keeps the MAX_SAMPLES most recent of them."""
    a, b = TrustGate(0.05), TrustGate(0.05)
    for i in range(6):
        a.add("cell", GateSample(0.1, 0.01 * i), queued=False)
        b.add("cell", GateSample(0.2, 0.02 * i), queued=False)
    assert a.merge(b.to_bytes()) == Merged(6, 6), "b lacks a's six"
    assert b.merge(a.to_bytes()) == Merged(6, 0)
    assert a.summary() == b.summary() and a.summary()[0].samples == 12
    assert (
        a.margin("cell")
        == b.margin("cell")
        == threshold(
            [GateSample(0.1, 0.01 * i) for i in range(6)] + [GateSample(0.2, 0.02 * i) for i in range(6)],
            0.05,
        )
    )
    for _ in range(MAX_SAMPLES):
        b.add("cell", GateSample(0.3, 0.0), queued=False)
    assert a.merge(b.to_bytes()).taken == MAX_SAMPLES
    (cell,) = a.summary()
    assert cell.samples == MAX_SAMPLES and cell.kl_mean == 0.0, "the oldest went"


def test_a_restarted_engine_keeps_its_calibration_beside_the_stored_segments(
    model_dir: Path, tmp_path: Path
) -> None:
    store = {"store_dir": str(tmp_path / "store")}
    first = LLM(model=str(model_dir), fidelity_target=1e-9, audit_ratio=0.0, store=store, **SETTINGS)
    _ask(first, _reordered(0), UNREPAIRED)
    for i in range(MIN_SAMPLES):
        _ask(first, _reordered(i + 1), UNREPAIRED)
    (cell,) = first.engine.stats().gate
    assert cell.threshold == math.inf
    first.close()
    restarted = LLM(model=str(model_dir), fidelity_target=1e-9, audit_ratio=0.0, store=store, **SETTINGS)
    (kept,) = restarted.engine.stats().gate
    assert (kept.key, kept.samples, kept.threshold) == (cell.key, MIN_SAMPLES, math.inf)
    _ask(restarted, _reordered(0), UNREPAIRED)  # its documents, from the disk tier or computed
    out = _ask(restarted, _reordered(MIN_SAMPLES + 1), UNREPAIRED)
    assert out.metrics.segment_hit_tokens > 0 and out.metrics.repair_fallback, "calibrated at start"
    restarted.close()


def test_a_fallback_recomputes_spliced_kv_its_cached_prefix_took_from_an_earlier_request(
    model_dir: Path,
) -> None:
    # Documents that open alike: under segment keys a prompt opening with B hits the first tokens of an
    # earlier prompt that opened with A, whose KV there was spliced (approximate). They lie in the hit's
    # last, partial block (SYSTEM is 9 tokens, blocks are 8): the fallback must recompute them too.
    a, b, c = [7, 8, *DOCS[0][2:]], [7, 8, *DOCS[1][2:]], DOCS[2]
    settings = {**SETTINGS, "prefix_cache": "radix"}
    llm = LLM(model=str(model_dir), fidelity_target=1e-9, audit_ratio=0.0, **settings)
    plain = LLM(model=str(model_dir), **SETTINGS)
    for docs in ([c, a, b], [a, c, b]):
        _ask_docs(llm, docs)
    # The cell's audits say its splices are far from a full prefill: every request of it falls back.
    gate = llm.engine.gate
    assert gate is not None
    (cell,) = gate.summary()
    for _ in range(MIN_SAMPLES):
        gate.add(cell.key, GateSample(0.5, 1.0), queued=False)
    got = _ask_docs(llm, [b, a, c])
    assert got.metrics.prefix_hit_tokens == len(SYSTEM) + 2 and got.metrics.repair_fallback
    want = plain.generate([[*SYSTEM, *b, *a, *c, *QUESTION]], FIRST)[0]
    assert kl_divergence(want.first_logits, got.first_logits) < 1e-6


def _ask_docs(llm: LLM, docs: list[list[int]]) -> Any:
    out = llm.generate([[SYSTEM, *map(Segment, docs), QUESTION]], FIRST, UNREPAIRED)[0]
    while llm.engine.has_unfinished():
        llm.engine.step()
    return out


def test_replicas_sharing_a_redis_calibrate_a_shape_once(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every step merges (no wait between merges): replica B learns what A's audits found while both run.
    monkeypatch.setattr(gate_sync, "SYNC_S", 0.0)
    server = RedisServer(tmp_path / "redis").start()
    try:
        store = {"store_url": server.url}
        a, b = (
            LLM(model=str(model_dir), fidelity_target=1e-9, audit_ratio=0.0, store=store, **SETTINGS)
            for _ in range(2)
        )
        _ask(a, _reordered(0), UNREPAIRED)
        for i in range(MIN_SAMPLES):
            _ask(a, _reordered(i + 1), UNREPAIRED)
        (cell,) = a.engine.stats().gate
        assert cell.threshold == math.inf
        assert a.engine.flush()
        _ask(b, _reordered(0), UNREPAIRED)  # its documents, from Redis
        background = b.engine.stats().background_tokens
        out = _ask(b, _reordered(MIN_SAMPLES + 1), UNREPAIRED)
        assert out.metrics.segment_hit_tokens > 0 and out.metrics.repair_fallback, "calibrated by A"
        (shared,) = b.engine.stats().gate
        assert (shared.key, shared.threshold) == (cell.key, math.inf)
        assert b.engine.stats().background_tokens == background, "B audited nothing"
        a.close()
        b.close()
    finally:
        server.kill()
