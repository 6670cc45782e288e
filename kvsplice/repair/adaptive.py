"""Adaptive repair: the budget is chosen per request, by how much more repair still changes the answer.

Its knob is a quality target, not a ratio: `target`, a KL divergence (nats) between the next-token
distributions of two successive rounds of repair. The rounds:

  0. the computed tokens (the question) run through every layer over the moved, unrepaired KV,
     while the question's attention on the global probe layers ranks the reused tokens (the query
     policy's signal); their next-token distribution is the first estimate;
  1. the top `FIRST_SHARE` of the ranked reused tokens are recomputed, from the first layer, with the
     computed tokens: a second estimate;
  2. ... each later round doubles the recomputed share with the next-ranked tokens, until two
     successive estimates differ by at most `target`.

A repair that has not converged by `FALLBACK_SHARE` of the reused tokens is not trusted: the last
round recomputes every reused token at once, which equals a full prefill. Successive estimates
converging is evidence, not proof, that the answer is close to a full prefill's; the bench measures
how close (kvsplice bench recall).

Nor is a request whose question spreads its attention over the reused tokens (few-shot, where the
answer depends on every example): if the `COVERAGE_SHARE` of them the question attends to most hold
less than `TRUSTED_COVERAGE` of its attention on reused tokens, no sparse repair reaches the tokens
that matter, and the first round recomputes them all (a full prefill's result). Successive rounds
cannot see that: on few-shot they agreed with each other while far from the full prefill (KL 0.345,
bench/results/fewshot_adaptive). Measured with lead@15's probe (Gemma 3): the top 15% held 0.55 to
0.62 of the question's attention on few-shot (8 requests) and 0.79 to 0.84 on recall with 8
documents (12 requests, every answer position). The threshold is Gemma 3's: on SmolLM2, whose probe
watches layer 8, both workloads clear it (30 requests each; few-shot accuracy 83% against the full
prefill's 80% by repair alone, bench/results/fewshot_smollm2_adaptive_probe8).
"""

from __future__ import annotations

import math

import torch

from kvsplice.repair.base import Probe, RepairDecision, RepairPolicy, RepairTask
from kvsplice.repair.query import QueryAttentionObserver, question_probe
from kvsplice.reuse.plan import SpanKind
from kvsplice.sampling import kl_divergence

FIRST_SHARE = 0.05
# The share of reused tokens, ranked by the question's attention, whose attention mass says whether a
# sparse repair can be trusted, and the least mass they must hold (between few-shot's 0.62 at most
# and recall's 0.79 at least).
COVERAGE_SHARE = 0.15
TRUSTED_COVERAGE = 0.7
# Beyond this share a spliced prefill saves at most half of a full one's work, and a repair that is
# still moving the answer there is not close to converging: pay for the full prefill instead.
FALLBACK_SHARE = 0.5


class AdaptiveRepair(RepairPolicy):
    """Recompute query-ranked reused tokens in doubling rounds until the answer stops moving."""

    name = "adaptive"
    budgeted = False

    def __init__(self) -> None:
        # Spliced positions, most attended first; the share recomputed so far; the last estimate.
        self._ranked: list[int] = []
        self._taken = 0
        self._last: torch.Tensor | None = None

    def decide(self, task: RepairTask) -> RepairDecision:
        if not task.plan.positions(SpanKind.SPLICED):
            return RepairDecision()
        # Through every layer: the probe's logits are the first estimate.
        return RepairDecision(probe=question_probe(task, task.num_layers - 1))

    def choose(self, task: RepairTask, probe: Probe, logits: torch.Tensor | None) -> tuple[int, ...]:
        assert isinstance(probe.observer, QueryAttentionObserver) and logits is not None
        spliced = torch.tensor(task.plan.positions(SpanKind.SPLICED))
        score = probe.observer.score[spliced]
        order = torch.argsort(score, descending=True, stable=True)
        self._ranked = spliced[order].tolist()
        self._last = logits
        if coverage(score, COVERAGE_SHARE) < TRUSTED_COVERAGE:
            return self._take(len(self._ranked))
        return self._take(max(1, math.ceil(FIRST_SHARE * len(self._ranked))))

    def refine(self, task: RepairTask, logits: torch.Tensor) -> tuple[int, ...] | None:
        total = len(self._ranked)
        if self._last is None or self._taken == total or kl_divergence(logits, self._last) <= task.target:
            # (No estimate yet: nothing was spliced, so there was no probe.)
            return None
        self._last = logits
        if 2 * self._taken > FALLBACK_SHARE * total:
            self._taken = total
            return tuple(sorted(self._ranked))
        return self._take(min(total, 2 * self._taken) - self._taken)

    def _take(self, count: int) -> tuple[int, ...]:
        chosen = self._ranked[self._taken : self._taken + count]
        self._taken += count
        return tuple(sorted(chosen))


def coverage(score: torch.Tensor, share: float) -> float:
    """The share of the total attention mass `score` [reused tokens] that its top `share` of tokens
    hold (1.0 when there is no mass to spread)."""
    total = float(score.sum())
    if total <= 0:
        return 1.0
    k = max(1, math.ceil(share * score.numel()))
    return float(score.topk(k).values.sum()) / total
