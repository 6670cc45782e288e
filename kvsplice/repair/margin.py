"""Margin repair: recompute the reused tokens whose KV most moves the first token's margin.

`lead` ranks reused tokens by the attention the question pays them on one layer, every head alike.
What a spliced request gets wrong is mostly its first token on a near-tie (docs/fidelity.md), so this
policy ranks them by what decides that: the question runs over the moved, unrepaired KV with
gradients and each reused token is scored by the first-order effect of its KV on the lead of the most
likely next token over the runner-up (kv/attribution.py). The choice is `lead`'s (the first segment's
best up to half the budget, then the best anywhere) by that score. The probe runs the computed tokens
but the question's last ones through every layer over the moved, unrepaired KV, then those with
gradients, then the question and the chosen again from the first layer.

It pays for that out of its budget: the probe's FLOPs beyond `lead`'s, in reused tokens' worth, are
taken off the tokens it recomputes (`probe_cost`), so at a ratio it costs what `lead` does at the same
ratio. Where that would leave less than `LEAD_BELOW` of the budget (a long question over few reused
tokens: few-shot prompts) it probes and chooses as `lead` does.

Measured on recall, held out, against lead@15 in the same run (bench/results/recall_margin). On
SmolLM2, 8 documents, seed 19, 100 requests, paying for its probe: margin@15 at 17.5% of a full
prefill's FLOPs against 18.1%, KL 0.050 -> 0.031 (paired -0.020 [-0.033, -0.005]), within 0.05 71% ->
87%, first token 80% -> 85%, accuracy 49% -> 46% (full 45%). Pooled with three earlier runs of
margin@12 (its own ratio then, at the same FLOPs; 8 and 12 documents), 300 requests: KL 0.050 ->
0.026, within 0.05 71% -> 87%, first token 83% -> 87%, answers as right or wrong as the full
prefill's on 281 against 279, accuracy -1.3 points [-4.0, +1.3] against lead's; TTFT p50 about 18%
longer (autograd's backward on the CPU). At 12 documents, seed 22, 60 requests: 18.7% against 19.6%,
KL 0.044 -> 0.032, within 0.05 77% -> 90%, first token 83% -> 92%, accuracy 42% -> 38% (full 43%);
pooled with it, 360 requests, accuracy -1.7 points [-4.2, +0.6] against lead's (-2.2 [-4.7, +0.3]
against the full prefill's, lead's -0.6 [-3.3, +2.2]). Closer in distribution and in first tokens,
fewer answers right, TTFT longer: not the default. On Gemma 3
with its segment shift margin@15 was no closer than lead@15 (seeds 14 and 15, 100 requests: +0.004
[-0.003, +0.013] and +0.000 [-0.005, +0.006]).
"""

from __future__ import annotations

import math

import torch

from kvsplice.kv.attribution import MarginAttribution
from kvsplice.models.flops import FlopModel
from kvsplice.repair.base import Probe, RepairDecision, RepairPolicy, RepairTask, probe_unless_settled
from kvsplice.repair.query import QueryAttentionObserver, lead_choice, probe_layers, question_probe

# The attributed pass runs the question's last this many tokens (the rest of it runs forward in the
# probe, its KV read like the reused tokens'): the backward costs about 1.4x the forward of what it runs,
# and a few-shot prompt's question (a new text to label) is long. On the recall prompts the question is
# shorter, all of it attributed.
ATTRIBUTED_TOKENS = 32
# Where paying for the probe leaves less than this share of the budget, `lead`'s ranking at the whole
# budget is taken instead. Not tuned: on SmolLM2's recall prompts (a question of some 25 tokens over
# 2,400 reused) the probe costs a fifth of the budget, on its few-shot prompts (some 85 computed
# tokens, most of them the question, over 620 reused) more than half.
LEAD_BELOW = 0.5


class MarginRepair(RepairPolicy):
    """Recompute the reused tokens whose KV moves the first token's margin most, the first segment first."""

    name = "margin"

    def __init__(self) -> None:
        # How many tokens the chosen may be once the probe is paid for (the whole budget under lead's probe).
        self._budget = 0

    def decide(self, task: RepairTask) -> RepairDecision:
        def probe(stale: tuple[int, ...]) -> Probe:
            assert task.model is not None, "the margin policy prices its probe by the model's layers"
            queries = task.plan.question()[-ATTRIBUTED_TOKENS:]
            self._budget = task.budget - probe_cost(task, queries, stale)
            if self._budget < LEAD_BELOW * task.budget:
                self._budget = task.budget
                return question_probe(task, max(probe_layers(task.model)))
            attribution = MarginAttribution(task.plan.num_tokens, queries)
            return Probe((), task.num_layers - 1, None, resume=False, attribution=attribution)

        return probe_unless_settled(task, probe)

    def choose(self, task: RepairTask, probe: Probe, logits: torch.Tensor | None) -> tuple[int, ...]:
        if probe.attribution is None:
            assert isinstance(probe.observer, QueryAttentionObserver)
            return lead_choice(task.plan, probe.observer.score, self._budget)
        assert probe.attribution.done
        return lead_choice(task.plan, probe.attribution.score, self._budget)


def probe_cost(task: RepairTask, queries: tuple[int, ...], stale: tuple[int, ...]) -> int:
    """How many of the `stale` tokens' worth of FLOPs (each through every layer, on average) the margin
    probe with these attributed `queries` costs beyond `lead`'s probe (repair/query.py), rounded up.

    Both recompute the chosen and run the computed tokens outside the question once through every
    layer. `lead` runs the question through its probe's layers twice and the rest once; margin runs the
    question's earlier tokens through every layer twice, and its attributed ones attributed (forward and
    backward, models/flops.py) and then again. The LM head's few rows are left out."""
    assert task.model is not None and stale
    flops = FlopModel(task.model)
    every = range(task.num_layers)
    beyond = range(max(probe_layers(task.model)) + 1, task.num_layers)
    attributed = set(queries)
    earlier = [p for p in task.plan.question() if p not in attributed]
    extra = (
        flops.forward(earlier, beyond)
        + flops.attributed(queries, every)
        - flops.forward(queries, range(beyond.start))
    )
    return math.ceil(extra / (flops.forward(stale, every) / len(stale)))
