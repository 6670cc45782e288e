"""The reference and baseline repair policies: none, full, boundary (EPIC), deviation (CacheBlend); the
default, lead, is in query.py."""

from __future__ import annotations

import torch

from kvsplice.kv.context import ForwardContext
from kvsplice.plan import SpanKind
from kvsplice.repair.base import Probe, RepairDecision, RepairPolicy, RepairTask, probe_unless_settled


class NoRepair(RepairPolicy):
    """Naive reuse: moved KV is used as is (the quality floor)."""

    name = "none"

    def decide(self, task: RepairTask) -> RepairDecision:
        return RepairDecision()


class FullRepair(RepairPolicy):
    """Recompute every reused token: equals a full prefill, at a full prefill's cost."""

    name = "full"
    exact = True

    def decide(self, task: RepairTask) -> RepairDecision:
        return RepairDecision(tuple(task.plan.positions(SpanKind.SPLICED)))


class BoundaryRepair(RepairPolicy):
    """EPIC's LegoLink: recompute the first tokens of every reused segment, where the attention-sink
    behaviour a segment learnt on its own distorts the KV most; the budget is split evenly (over the
    segments with approximate KV: a lead KV computed after the same head is exact)."""

    name = "boundary"

    def decide(self, task: RepairTask) -> RepairDecision:
        spans = [s for s in task.plan.spliced() if not s.lead_kv]
        if not spans or task.budget <= 0:
            return RepairDecision()
        share, extra = divmod(task.budget, len(spans))
        chosen: list[int] = []
        for i, span in enumerate(spans):
            take = min(len(span), share + (i < extra))
            chosen += range(span.start, span.start + take)
        return RepairDecision(tuple(chosen))


class DeviationObserver:
    """Sums, per probed position, the squared distance between the K/V a layer computes for it now and
    the (moved) K/V the pool held in its slot before: CacheBlend's signal of stale KV."""

    def __init__(self, positions: tuple[int, ...], layers: frozenset[int], length: int) -> None:
        self.layers = layers
        self.score = torch.zeros(length)  # [prompt tokens]; only probed positions are ever written
        self._probed = torch.zeros(length, dtype=torch.bool)
        self._probed[list(positions)] = True

    def observe(
        self, layer: int, ctx: ForwardContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k, v: [1, T, Hkv, D], the new K/V of the pass's queries on `layer`, not yet written."""
        positions = ctx.positions[0].cpu()
        rows = self._probed[positions].nonzero().squeeze(1)  # [C] queries that are probed
        if rows.numel() == 0:
            return
        device_rows = rows.to(ctx.write_slots.device)
        old_k, old_v = ctx.pool.read(layer, ctx.write_slots[0, device_rows])  # [C, Hkv, D]
        k_dev = (k[0, device_rows] - old_k.to(k.dtype)).square().sum(dim=(-2, -1))
        v_dev = (v[0, device_rows] - old_v.to(v.dtype)).square().sum(dim=(-2, -1))
        self.score[positions[rows]] += (k_dev + v_dev).float().cpu()


class DeviationRepair(RepairPolicy):
    """CacheBlend: recompute every reused token on the first layer(s), then keep recomputing only the
    tokens whose K/V deviate most from the reused K/V; their new KV replaces the reused KV for the
    tokens after them."""

    name = "deviation"

    def __init__(self, probe_layer: int = 1) -> None:
        # Layer 0's K/V depend only on the token and its position, so they never deviate: the first
        # layer where context shows is layer 1. Candidates are computed through the probe layer.
        self.probe_layer = probe_layer

    def decide(self, task: RepairTask) -> RepairDecision:
        last = min(self.probe_layer, task.num_layers - 1)

        # The stale tokens only, not those spliced from lead KV: exact, they would only cost the probe.
        def probe(stale: tuple[int, ...]) -> Probe:
            return Probe(stale, last, DeviationObserver(stale, frozenset({last}), task.plan.num_tokens))

        return probe_unless_settled(task, probe)

    def choose(self, task: RepairTask, probe: Probe, logits: torch.Tensor | None) -> tuple[int, ...]:
        assert isinstance(probe.observer, DeviationObserver)
        candidates = torch.tensor(probe.positions)
        score = probe.observer.score[candidates]
        top = torch.topk(score, min(task.budget, len(candidates))).indices
        return tuple(sorted(candidates[top].tolist()))
