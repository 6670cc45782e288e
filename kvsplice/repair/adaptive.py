"""Adaptive repair: the budget is chosen per request, by how much more repair still changes the answer.

It stops at a quality target, not a budget: `TARGET`, a KL divergence (nats) between the next-token
distributions of two successive rounds of repair. The rounds:

  0. the computed tokens (the question) run through every layer over the moved, unrepaired KV,
     while the question's attention on the global probe layers ranks the reused tokens (the query
     policy's signal); their next-token distribution is the first estimate;
  1. `FIRST_SHARE` of the reused tokens, chosen as `lead` would choose that many (the first segment's
     most attended up to half of them, then the most attended anywhere), are recomputed, from the
     first layer, with the computed tokens: a second estimate;
  2. ... each later round recomputes `lead`'s choice at twice the share, the earlier rounds' tokens
     with it, until two successive estimates differ by at most `TARGET`.

Reused tokens here are those with approximate KV (plan.stale(): not a lead KV computed after the
same head, which is exact). A repair that has not converged by `FALLBACK_SHARE` of them is not
trusted: the last round recomputes every one at once, which equals a full prefill. Successive estimates
converging is evidence, not proof, that the answer is close to a full prefill's; the bench measures
how close (kvsplice bench recall).

Nor is a request whose question spreads its attention over the reused tokens (few-shot, where the
answer depends on every example): if the `COVERAGE_SHARE` of them the question attends to most hold
less than `TRUSTED_COVERAGE` of its attention on reused tokens, no sparse repair reaches the tokens
that matter, and the first round recomputes them all (a full prefill's result). Successive rounds
cannot see that: on few-shot they agreed with each other while far from the full prefill. The
threshold is Gemma 3's; on SmolLM2 both workloads clear it. docs/design.md gives the numbers.
"""

from __future__ import annotations

import math

import torch

from kvsplice.plan import SpanKind
from kvsplice.repair.attention import QueryAttentionObserver, attention_choice, question_probe
from kvsplice.repair.base import Probe, RepairDecision, RepairPolicy, RepairTask
from kvsplice.sampling import kl_divergence

# The first round recomputes what `attention@15` would, and its move from the unrepaired estimate decides
# whether more follows: from a smaller first round the rounds agreed with each other long before the
# answer was right (docs/design.md).
FIRST_SHARE = 0.15
# Two successive estimates this close (KL, nats) end the repair.
TARGET = 0.05
# The share of reused tokens, ranked by the question's attention, whose attention mass says whether a
# sparse repair can be trusted, and the least mass they must hold (between what few-shot and recall
# measured: docs/design.md).
COVERAGE_SHARE = 0.15
TRUSTED_COVERAGE = 0.7
# Beyond this share a spliced prefill saves at most half of a full one's work, and a repair that is
# still moving the answer there is not close to converging: pay for the full prefill instead.
FALLBACK_SHARE = 0.5


class AdaptiveRepair(RepairPolicy):
    """Recompute reused tokens in `lead`'s order, in doubling rounds, until the answer stops moving."""

    name = "adaptive"
    budgeted = False

    def __init__(self) -> None:
        # The question's attention [prompt tokens]; the spliced positions recomputed so far; the last
        # estimate.
        self._score = torch.zeros(0)
        self._taken: tuple[int, ...] = ()
        self._last: torch.Tensor | None = None

    def decide(self, task: RepairTask) -> RepairDecision:
        if not task.plan.stale():
            return RepairDecision()
        # Through every layer: the probe's logits are the first estimate.
        return RepairDecision(probe=question_probe(task, task.num_layers - 1))

    def choose(self, task: RepairTask, probe: Probe, logits: torch.Tensor | None) -> tuple[int, ...]:
        assert isinstance(probe.observer, QueryAttentionObserver) and logits is not None
        stale = task.plan.stale()
        self._score = probe.observer.score
        self._last = logits
        if coverage(self._score[stale], COVERAGE_SHARE) < TRUSTED_COVERAGE:
            return self._take(task, len(stale))
        # attention@15's choice: a share of every reused token (lead KV too), spent on the stale ones.
        first = math.ceil(FIRST_SHARE * task.plan.tokens(SpanKind.SPLICED))
        return self._take(task, min(len(stale), max(1, first)))

    def refine(self, task: RepairTask, logits: torch.Tensor) -> tuple[int, ...] | None:
        taken, total = len(self._taken), len(task.plan.stale())
        if self._last is None or taken == total or kl_divergence(logits, self._last) <= TARGET:
            # (No estimate yet: nothing was spliced, so there was no probe.)
            return None
        self._last = logits
        if 2 * taken > FALLBACK_SHARE * total:
            # Every reused token: one pass that equals a full prefill.
            return self._take(task, total)
        return self._take(task, min(total, 2 * taken))

    def _take(self, task: RepairTask, count: int) -> tuple[int, ...]:
        """`lead`'s choice at a budget of `count`, all of it, the earlier rounds' tokens again: a round
        that only added tokens left the earlier ones with KV computed over the added ones' stale KV,
        and was worth little against the larger budget in one pass (docs/design.md)."""
        chosen = attention_choice(task.plan, self._score, count)
        # Nested, so no earlier round's token is left out with KV computed over stale KV.
        assert set(self._taken) <= set(chosen), "lead's choice is nested in its budget"
        self._taken = chosen
        return chosen


def coverage(score: torch.Tensor, share: float) -> float:
    """The share of the total attention mass `score` [reused tokens] that its top `share` of tokens
    hold (1.0 when there is no mass to spread)."""
    total = float(score.sum())
    if total <= 0:
        return 1.0
    k = max(1, math.ceil(share * score.numel()))
    return float(score.topk(k).values.sum()) / total
