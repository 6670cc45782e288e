"""A chat turn that extends an earlier spliced prompt inherits its KV as a prefix (cache/segment_keys.py):
admission copies that approximate KV out of the blocks it shares with the prefix cache, so that the
trust gate can send the turn to a full prefill, which recomputes all of it, and the cached KV other turns
inherit stays as it was. Checked against an independent full prefill (a plain engine, prompts without
markup). Tiny random-weight model, token-id prompts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvsplice import LLM, RequestOptions, SamplingParams, Segment
from kvsplice.repair.gate import MAX_SAMPLES, MIN_SAMPLES, GateSample, gate_cell
from kvsplice.sampling import kl_divergence
from tests import tiny_models

rng = random.Random(12)
SYSTEM = [rng.randrange(1, 320) for _ in range(9)]
DOCS = [[rng.randrange(1, 320) for _ in range(40)] for _ in range(3)]
QUESTION = [rng.randrange(1, 320) for _ in range(6)]
# The next turn: a reply and another question after the first turn's prompt.
FOLLOW_UP = [rng.randrange(1, 320) for _ in range(13)]
# The next turn's prefix hit: the first turn's prompt (the radix cache matches to the token).
HIT = len(SYSTEM) + 80 + len(QUESTION)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, return_first_logits=True)
# Unrepaired splicing: inherited KV far enough from a full prefill to tell apart.
OPTIONS = RequestOptions(repair="none")
SETTINGS = {"block_size": 8, "kv_cache_gb": 0.01, "num_threads": 1, "prefix_cache": "radix"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("LlamaForCausalLM")
    tiny_models.save("LlamaForCausalLM", directory)
    return directory


def _turns(llm: LLM) -> Any:
    """Store the documents, splice them in a new order (the first turn), then send the next turn;
    returns the next turn's output."""
    _ask(llm, [SYSTEM, *map(Segment, DOCS), QUESTION])
    first = [SYSTEM, Segment(DOCS[2]), Segment(DOCS[0]), QUESTION]
    out = _ask(llm, first)
    assert out.metrics.segment_hit_tokens == 80, "the first turn splices both documents"
    return _ask(llm, [*first, FOLLOW_UP])


def _ask(llm: LLM, prompt: list) -> Any:
    out = llm.generate([prompt], FIRST, OPTIONS)[0]
    while llm.engine.has_unfinished():
        llm.engine.step()
    return out


def _distrusting(model_dir: Path) -> tuple[LLM, str]:
    """An engine whose gate has samples that say the inherited-prefix cell (unrepaired) is far from a
    full prefill: its requests fall back. Returns the engine and the cell's key."""
    llm = LLM(model=str(model_dir), fidelity_target=1e-9, audit_ratio=0.0, **SETTINGS)
    gate = llm.engine.gate
    assert gate is not None
    key = gate_cell("inherited prefix", "none", llm.engine.config.recompute_ratio)
    for _ in range(MIN_SAMPLES):
        gate.add(key, GateSample(0.5, 1.0), queued=False)
    return llm, key


def _full(model_dir: Path) -> Any:
    plain = LLM(model=str(model_dir), **{**SETTINGS, "prefix_cache": "off"})
    return plain.generate([[*SYSTEM, *DOCS[2], *DOCS[0], *QUESTION, *FOLLOW_UP]], FIRST)[0]


def test_a_fallback_after_an_inherited_prefix_is_a_full_prefill(model_dir: Path) -> None:
    # The next turn's hit is the first turn's prompt (9 + 80 + 6 tokens), its spliced KV over several
    # whole blocks of 8: shared with the cache unless admission copies it.
    llm, _ = _distrusting(model_dir)
    got = _turns(llm)
    assert got.metrics.prefix_hit_tokens == HIT and got.metrics.segment_hit_tokens == 0
    assert got.metrics.repair_fallback, "the gate judges a turn that only inherits"
    want = _full(model_dir)
    assert kl_divergence(want.first_logits, got.first_logits) < 1e-6


def test_a_fallback_leaves_the_cached_kv_other_turns_inherit_as_it_was(model_dir: Path) -> None:
    llm, key = _distrusting(model_dir)
    first = [SYSTEM, Segment(DOCS[2]), Segment(DOCS[0]), QUESTION]
    _ask(llm, [SYSTEM, *map(Segment, DOCS), QUESTION])
    before = _ask(llm, first)
    assert _ask(llm, [*first, FOLLOW_UP]).metrics.repair_fallback
    # Samples that say the cell is exact replace the others: the first turn, sent again, inherits its own
    # cached KV (all but its last token) and keeps it, the same logits, not a full prefill's.
    assert llm.engine.gate is not None
    for _ in range(MAX_SAMPLES):
        llm.engine.gate.add(key, GateSample(0.5, 0.0), queued=False)
    again = _ask(llm, first)
    assert not again.metrics.repair_fallback
    assert again.metrics.prefix_hit_tokens == HIT - 1
    assert kl_divergence(before.first_logits, again.first_logits) < 1e-9
    want = LLM(model=str(model_dir), **{**SETTINGS, "prefix_cache": "off"}).generate(
        [[*SYSTEM, *DOCS[2], *DOCS[0], *QUESTION]], FIRST
    )[0]
    assert kl_divergence(want.first_logits, again.first_logits) > 1e-4, "the cached KV is approximate"


def test_without_memory_to_copy_an_inherited_prefix_stays_shared_and_unchanged(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where memory is short for the copy, the turn keeps the inherited blocks shared: it is served from
    them as an engine without a gate would serve it (a fallback could not recompute them in place), and
    the cached KV other turns inherit stays as it was. The shortage is made by refusing any allocation
    of more blocks than a copy of only the partial last block takes."""
    llm, key = _distrusting(model_dir)
    first = [SYSTEM, Segment(DOCS[2]), Segment(DOCS[0]), QUESTION]
    _ask(llm, [SYSTEM, *map(Segment, DOCS), QUESTION])
    before = _ask(llm, first)
    bs = SETTINGS["block_size"]
    # The next turn's blocks from the partial last one of its hit on: 108 prompt tokens + 1 generated.
    partial_copy = -(-(HIT + len(FOLLOW_UP) + 1) // bs) - HIT // bs
    allocate = llm.engine.blocks._allocate
    asked: list[int] = []

    def short(n: int) -> list[int] | None:
        asked.append(n)
        return allocate(n) if n <= partial_copy else None

    monkeypatch.setattr(llm.engine.blocks, "_allocate", short)
    got = _ask(llm, [*first, FOLLOW_UP])
    monkeypatch.undo()
    assert asked[0] > partial_copy and asked[-1] == partial_copy, "copy refused, partial copy taken"
    assert got.metrics.prefix_hit_tokens == HIT and not got.metrics.repair_fallback

    ungated = LLM(model=str(model_dir), fidelity_target=0.0, **SETTINGS)
    _ask(ungated, [SYSTEM, *map(Segment, DOCS), QUESTION])
    _ask(ungated, first)
    want = _ask(ungated, [*first, FOLLOW_UP])
    assert kl_divergence(want.first_logits, got.first_logits) < 1e-9
    # As above: with the cell trusted, the first turn sent again is served from its cached KV.
    assert llm.engine.gate is not None
    for _ in range(MAX_SAMPLES):
        llm.engine.gate.add(key, GateSample(0.5, 0.0), queued=False)
    again = _ask(llm, first)
    assert not again.metrics.repair_fallback and again.metrics.prefix_hit_tokens == HIT - 1
    assert kl_divergence(before.first_logits, again.first_logits) < 1e-9, "the shared KV was not written"
