"""Margin repair: recompute the reused tokens whose KV most moves the first token's margin.

`lead` ranks reused tokens by the attention the question pays them on one layer, every head alike.
What a spliced request gets wrong is mostly its first token on a near-tie (docs/fidelity.md), so this
policy ranks them by what decides that: the question runs over the moved, unrepaired KV with
gradients and each reused token is scored by the first-order effect of its KV on the lead of the most
likely next token over the runner-up (kv/attribution.py). The choice is `lead`'s (the first segment's
best up to half the budget, then the best anywhere) by that score. The probe runs the computed tokens
but the question's last ones through every layer over the moved, unrepaired KV, then those with
gradients (the backward about 1.4x their forward), then the question and the chosen again from the
first layer: about 3 points of a full prefill's FLOPs more than `lead`'s probe on SmolLM2's recall
prompts, so its own budget is 12% (`default_ratio`).

Measured on recall (8 documents, each against lead@15 in the same run; bench/results/recall_margin):
on SmolLM2 margin@12, at no more FLOPs than lead@15, held out: seed 18 (100 requests) KL 0.056 ->
0.026 (paired -0.031 [-0.054, -0.015]), within 0.05 73% -> 84%, first token 85% -> 90%; seed 16 (60)
0.038 -> 0.021, 72% -> 88%; 12 documents, seed 17 (40) 0.047 -> 0.023, 68% -> 90%. On Gemma 3 with
its segment shift margin@15 was no closer than lead@15 (seeds 14 and 15, 100 requests: +0.004
[-0.003, +0.013] and +0.000 [-0.005, +0.006]); margin@12 on the fair frontier (30 requests) KL 0.020
against lead@15's 0.016. Not a default: its answers are no better than lead's (accuracy 57% against
59% on seed 18, full 62%), and on SmolLM2's few-shot prompts, whose question is long, it costs 38% of
the FLOPs against lead@15's 27% (first token 61 of 70 against 65, accuracy 50 against 51, two seeds).
"""

from __future__ import annotations

import torch

from kvsplice.kv.attribution import MarginAttribution
from kvsplice.repair.base import Probe, RepairDecision, RepairPolicy, RepairTask, probe_unless_settled
from kvsplice.repair.query import lead_choice

# The attributed pass runs the question's last this many tokens (the rest of it runs forward in the
# probe, its KV read like the reused tokens'): the backward costs about 1.4x the forward of what it runs,
# and a few-shot prompt's question (a new text to label) is long. On the recall prompts the question is
# shorter, all of it attributed.
ATTRIBUTED_TOKENS = 32


class MarginRepair(RepairPolicy):
    """Recompute the reused tokens whose KV moves the first token's margin most, the first segment first."""

    name = "margin"
    # Its probe costs about 3 points of a full prefill's FLOPs more than `lead`'s on the recall prompts,
    # so at 12% it costs what `lead` does at 15% (about 20%).
    default_ratio = 0.12

    def decide(self, task: RepairTask) -> RepairDecision:
        def probe(stale: tuple[int, ...]) -> Probe:
            queries = task.plan.question()[-ATTRIBUTED_TOKENS:]
            attribution = MarginAttribution(task.plan.num_tokens, queries)
            return Probe((), task.num_layers - 1, None, resume=False, attribution=attribution)

        return probe_unless_settled(task, probe)

    def choose(self, task: RepairTask, probe: Probe, logits: torch.Tensor | None) -> tuple[int, ...]:
        assert probe.attribution is not None and probe.attribution.done
        return lead_choice(task.plan, probe.attribution.score, task.budget)
