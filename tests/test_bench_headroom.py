"""The fidelity-target cost bound (bench/headroom.py) against a brute-force oracle over every set of
requests a policy could prefill in full."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.bench.headroom import Targets, headroom
from kvsplice.bench.metrics import RequestRecord

TARGETS = Targets(kl=0.05, close_share=0.75, top1=0.8, accuracy_drop=0.1)


def _pairs(draw: st.DrawFn, n: int) -> list[RequestRecord]:
    records = []
    for i in range(n):
        full_flops = draw(st.integers(50, 100))
        records.append(
            RequestRecord(
                "off",
                f"r{i}",
                setting="s",
                kl=0.0,
                top1=True,
                prefill_flops=full_flops,
                correct=draw(st.booleans()),
            )
        )
        records.append(
            RequestRecord(
                "splice", f"r{i}", setting="s", kl=draw(st.sampled_from([0.0, 0.01, 0.2, 1.0])),
                top1=draw(st.booleans()), prefill_flops=draw(st.integers(5, 20)), correct=draw(st.booleans()),
            )
        )  # fmt: skip
    return records


@st.composite
def runs(draw: st.DrawFn) -> list[RequestRecord]:
    return _pairs(draw, draw(st.integers(1, 7)))


def _meets(records: list[RequestRecord], full: set[str]) -> bool:
    """Every target holds when the requests in `full` are prefilled in full (exact: the reference's)."""
    refs = {r.request_id: r for r in records if r.system == "off"}
    sys = [r if r.request_id not in full else refs[r.request_id] for r in records if r.system == "splice"]
    n = len(sys)
    close = sum(r.kl is not None and r.kl <= TARGETS.kl for r in sys)
    agree = sum(bool(r.top1) for r in sys)
    correct, correct_ref = sum(bool(r.correct) for r in sys), sum(bool(r.correct) for r in refs.values())
    return (
        close >= TARGETS.close_share * n - 1e-9
        and agree >= TARGETS.top1 * n - 1e-9
        and correct >= correct_ref - TARGETS.accuracy_drop * n - 1e-9
    )


def _cheapest(records: list[RequestRecord]) -> tuple[int, float]:
    """The fewest full prefills and the least FLOPs (over all such sets) that meet every target."""
    flops = {(r.system, r.request_id): r.prefill_flops for r in records}
    ids = sorted({r.request_id for r in records})
    best_n, best_cost = math.inf, math.inf
    for k in range(len(ids) + 1):
        for chosen in itertools.combinations(ids, k):
            if _meets(records, set(chosen)):
                best_n = min(best_n, k)
                cost = sum(flops[("off", i)] if i in chosen else flops[("splice", i)] for i in ids)
                best_cost = min(best_cost, cost)
    return int(best_n), best_cost


@settings(max_examples=300, deadline=None)
@given(runs())
def test_bound_never_exceeds_the_cheapest_fallback(records: list[RequestRecord]) -> None:
    (row,) = headroom(records, "off", TARGETS)
    fewest, cheapest = _cheapest(records)
    full = sum(r.prefill_flops for r in records if r.system == "off")
    assert row.fallbacks <= fewest
    assert row.flops_bound <= cheapest / full + 1e-9
    if fewest == 0:
        assert row.fallbacks == 0 and math.isclose(row.flops_bound, row.flops_share)


@pytest.mark.parametrize("binding", ["kl", "top1", "accuracy"])
@settings(max_examples=100, deadline=None)
@given(records=runs())
def test_bound_is_exact_when_one_target_binds(binding: str, records: list[RequestRecord]) -> None:
    # The other two targets hold on every request, so only `binding` can call for a full prefill.
    for r in records:
        if binding != "kl":
            r.kl = 0.0
        if binding != "top1":
            r.top1 = True
        if binding != "accuracy":
            r.correct = True
    (row,) = headroom(records, "off", TARGETS)
    fewest, cheapest = _cheapest(records)
    full = sum(r.prefill_flops for r in records if r.system == "off")
    assert row.fallbacks == fewest
    assert math.isclose(row.flops_bound, cheapest / full)


def test_a_run_that_meets_the_targets_needs_no_fallback_and_one_that_misses_pays_for_it() -> None:
    records = []
    for i in range(4):
        records.append(
            RequestRecord(
                "off", f"r{i}", setting="8 docs", kl=0.0, top1=True, prefill_flops=100.0, correct=True
            )
        )
        records.append(
            RequestRecord(
                "lead", f"r{i}", setting="8 docs", kl=0.01, top1=True, prefill_flops=10.0, correct=True
            )
        )
    (met,) = headroom(records, "off")
    assert met.fallbacks == 0 and met.flops_bound == met.flops_share == 0.1
    records[-1].kl, records[-1].top1 = 0.3, False  # one of four misses: 75% < 95%, 75% < 98%
    (missed,) = headroom(records, "off")
    assert (missed.close_share, missed.top1, missed.fallbacks) == (0.75, 0.75, 1)
    assert math.isclose(missed.flops_bound, (30 + 100) / 400)  # fmt: skip
