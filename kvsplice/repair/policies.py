"""The repair policies: none, boundary (EPIC), deviation (CacheBlend), recency (kvsplice), full."""

from __future__ import annotations

import torch

from kvsplice.planner import Plan, SpanKind
from kvsplice.repair.base import RepairDecision, RepairPolicy, top_deviation


class NoRepair(RepairPolicy):
    """Naive reuse: moved KV is used as is (the quality floor)."""

    name = "none"

    def decide(self, plan: Plan, budget: int, num_layers: int) -> RepairDecision:
        return RepairDecision(())


class FullRepair(RepairPolicy):
    """Recompute every reused token: equals a full prefill, at a full prefill's cost."""

    name = "full"
    exact = True

    def decide(self, plan: Plan, budget: int, num_layers: int) -> RepairDecision:
        return RepairDecision(tuple(plan.positions(SpanKind.SPLICED)))


class BoundaryRepair(RepairPolicy):
    """EPIC's LegoLink: recompute the first tokens of every reused segment, where the attention-sink
    behaviour a segment learnt on its own distorts the KV most; the budget is split evenly."""

    name = "boundary"

    def decide(self, plan: Plan, budget: int, num_layers: int) -> RepairDecision:
        spans = plan.spliced()
        if not spans or budget <= 0:
            return RepairDecision(())
        share, extra = divmod(budget, len(spans))
        chosen: list[int] = []
        for i, span in enumerate(spans):
            take = min(len(span), share + (i < extra))
            chosen += range(span.start, span.start + take)
        return RepairDecision(tuple(chosen))


class DeviationRepair(RepairPolicy):
    """CacheBlend: recompute every reused token on the first layer(s), then keep recomputing only the
    tokens whose K/V deviate most from the reused K/V; their new KV replaces the reused KV for the
    tokens after them."""

    name = "deviation"

    def __init__(self, probe_layer: int = 1) -> None:
        # Layer 0's K/V depend only on the token and its position, so they never deviate: the first
        # layer where context shows is layer 1. Candidates are computed through the probe layer.
        self.probe_layer = probe_layer

    def decide(self, plan: Plan, budget: int, num_layers: int) -> RepairDecision:
        spliced = tuple(plan.positions(SpanKind.SPLICED))
        if not spliced or budget <= 0:
            return RepairDecision(())
        if budget >= len(spliced):
            return RepairDecision(spliced)
        return RepairDecision(spliced, (min(self.probe_layer, num_layers - 1),))

    def choose(self, deviation: dict[int, torch.Tensor], budget: int) -> torch.Tensor:
        return top_deviation(deviation, budget)


class RecencyRepair(RepairPolicy):
    """kvsplice's policy: recompute the reused tokens nearest the end of the prompt.

    The tokens after the last segment (the question) and every generated token attend, on a
    sliding-window layer, only to the last `window` positions; on Gemma 3, 5 of every 6 layers. Making
    the reused KV there consistent with the prompt therefore fixes most of what the answer reads,
    while stale KV further back is only read by the few global layers. Measured on Gemma 3 270M with
    six RAG documents, this beats both token selection by KV deviation and segment boundaries at the
    same budget (see bench/results). For a model without sliding windows the argument is weaker.
    """

    name = "recency"

    def decide(self, plan: Plan, budget: int, num_layers: int) -> RepairDecision:
        spliced = plan.positions(SpanKind.SPLICED)
        return RepairDecision(tuple(spliced[len(spliced) - budget :]) if budget > 0 else ())
