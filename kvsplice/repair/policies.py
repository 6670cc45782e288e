"""The repair policies: none, boundary (EPIC), deviation (CacheBlend), full."""

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

    def __init__(self, probe_layers: int = 1) -> None:
        self.num_probe_layers = probe_layers

    def decide(self, plan: Plan, budget: int, num_layers: int) -> RepairDecision:
        spliced = tuple(plan.positions(SpanKind.SPLICED))
        if not spliced or budget <= 0:
            return RepairDecision(())
        if budget >= len(spliced):
            return RepairDecision(spliced)
        return RepairDecision(spliced, tuple(range(min(self.num_probe_layers, num_layers))))

    def choose(self, deviation: dict[int, torch.Tensor], budget: int) -> torch.Tensor:
        return top_deviation(deviation, budget)
