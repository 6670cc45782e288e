"""Margin repair: recompute the reused tokens whose KV most moves the first token's margin.

`lead` ranks reused tokens by the attention the question pays them on one layer, every head alike.
What a spliced request gets wrong is mostly its first token on a near-tie (docs/fidelity.md), so this
policy ranks them by what decides that: after a probe of the computed tokens through every layer over
the moved, unrepaired KV, the question runs once more with gradients and each reused token is scored
by the first-order effect of its KV on the lead of the most likely next token over the runner-up
(kv/attribution.py). The choice is `lead`'s (the first segment's best up to half the budget, then the
best anywhere) by that score. The probe and the attributed pass cost the computed tokens through
every layer, the question once more and a backward pass: on SmolLM2's recall prompts 5 points of a
full prefill's FLOPs more than `lead`'s probe (18.6% -> 23.8% at 15%).

Measured on recall (8 documents, each against lead@15 in the same run, in a scratch form that chose the
same tokens; bench/results/recall_margin): SmolLM2 (seed 14, 60 requests) KL 0.044 -> 0.021 (paired
-0.023 [-0.039, -0.010], lower on 49), within 0.05 77% -> 88%, first token 77% -> 83%; Gemma 3 with
its segment shift (seeds 14 and 15, 100 requests) no different (+0.004 [-0.003, +0.013] and +0.000
[-0.005, +0.006]). Held out, this policy on SmolLM2 (seed 15, 40 requests): KL 0.037 -> 0.014 (-0.023
[-0.038, -0.012], lower on 36), within 0.05 75% -> 95%, first token 75% -> 82%, at 23.8% of the FLOPs
against 18.6% (the backward counted as two forwards) and TTFT p50 1.74 s against 1.18 s. Not a
default yet: 100 requests on two seeds, and over the 20% FLOPs target at 15%.
"""

from __future__ import annotations

import torch

from kvsplice.kv.attribution import MarginAttribution
from kvsplice.repair.base import Probe, RepairDecision, RepairPolicy, RepairTask, probe_unless_settled
from kvsplice.repair.query import lead_choice


class MarginRepair(RepairPolicy):
    """Recompute the reused tokens whose KV moves the first token's margin most, the first segment first."""

    name = "margin"

    def decide(self, task: RepairTask) -> RepairDecision:
        def probe(stale: tuple[int, ...]) -> Probe:
            attribution = MarginAttribution(task.plan.num_tokens)
            return Probe((), task.num_layers - 1, None, resume=False, attribution=attribution)

        return probe_unless_settled(task, probe)

    def choose(self, task: RepairTask, probe: Probe, logits: torch.Tensor | None) -> tuple[int, ...]:
        assert probe.attribution is not None and probe.attribution.done
        return lead_choice(task.plan, probe.attribution.score, task.budget)
