"""A repair run: the passes a repair policy asks for, one after another, as the prefill's work.

A policy decides at once (one pass through every layer) or after a probe (the probe's layers, then the
chosen tokens' rest); a policy that refines asks for more rounds after each full pass; a fallback
margin adds one pass that recomputes every stale token. Each pass carries the segment shift where it
recomputes spliced tokens (repair/shift.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvsplice.kv.context import LayerObserver
from kvsplice.plan import SpanKind
from kvsplice.repair.base import RepairPolicy, RepairTask
from kvsplice.repair.shift import SegmentShift
from kvsplice.reuse.work import Pass
from kvsplice.sampling import top_margin


class RepairRun:
    """The passes a repair policy asks for: one, or a probe pass and then the chosen tokens' rest."""

    def __init__(self, policy: RepairPolicy, task: RepairTask) -> None:
        self.policy = policy
        self.task = task
        plan, layers = task.plan, task.num_layers
        spliced = set(plan.positions(SpanKind.SPLICED))
        self._spliced = spliced
        self._compute = plan.positions(SpanKind.COMPUTE)
        # Each reused segment's approximate positions (lead KV is exact), for the segment shift; and,
        # per layer, the spliced positions some pass has recomputed there.
        by_segment: dict[int | None, list[int]] = {}
        for span in plan.spliced():
            if not span.lead_kv:
                by_segment.setdefault(span.segment, []).extend(range(span.start, span.end))
        self._segments = tuple(tuple(p) for p in by_segment.values())
        self._fresh: dict[int, set[int]] = {layer: set() for layer in range(layers)}
        # Whether the fallback margin sent the request to a full prefill (`_fall_back`).
        self.fell_back = False
        # Where it did: the first-token logits [vocab] repair gave before the fallback pass, and how many
        # stale tokens that pass recomputed beyond the policy's.
        self.spliced_logits: torch.Tensor | None = None
        self.fallback_tokens = 0
        self.decision = policy.decide(task)
        # A pass already decided that runs after the current one.
        self._queued: Pass | None = None
        probe = self.decision.probe
        if probe is None:
            assert set(self.decision.recompute) <= spliced, "a policy recomputes only spliced tokens"
            assert len(self.decision.recompute) <= task.budget or policy.exact, (
                f"{policy.name} recomputes {len(self.decision.recompute)} > {task.budget}"
            )
            self.recomputed: tuple[int, ...] | None = self.decision.recompute
            self.first = self._pass(_union(self._compute, self.decision.recompute), range(layers))
        else:
            assert set(probe.positions) <= spliced and 0 <= probe.last_layer < layers
            self.recomputed = None
            self.first = self._pass(
                _union(self._compute, probe.positions), range(probe.last_layer + 1), probe.observer
            )

    def next_pass(self, logits: torch.Tensor | None) -> Pass | None:
        probe = self.decision.probe
        if self._queued is not None:
            queued, self._queued = self._queued, None
            return queued
        if self.recomputed is not None:
            return self._refine(logits)
        assert probe is not None
        chosen = self.policy.choose(self.task, probe, logits)
        assert len(chosen) <= self.task.budget
        self.recomputed = chosen
        rest = self._pass(_union(self._compute, chosen), range(probe.last_layer + 1, self.task.num_layers))
        if not probe.resume:
            assert set(chosen) <= self._spliced
            if not rest.layers:
                # The probe ran every layer (the adaptive policy's first estimate): a round of repair
                # from the first layer, as `refine` asks for.
                return self._pass(_union(self._compute, chosen), range(self.task.num_layers))
            # The question (plan.question(): the computed tokens after the last reused one and after the
            # last marked segment, so not a new document that follows the last reused one) runs the
            # probe's layers again with the chosen, over their repaired KV: letting it resume (its first
            # layers over unrepaired KV) answered much further from a full prefill. The computed tokens
            # before it resume: those before the first chosen token compute the same either way; those
            # after it (documents new to the store, separators) saw the chosen tokens' KV unrepaired in
            # the probe's layers, which measured as no loss and saves those layers for every new
            # document (docs/design.md).
            again = _union(self.task.plan.question(), chosen)
            if not again:
                return rest
            if len(again) == len(rest.positions):  # nothing resumes: one pass from the first layer
                return self._pass(again, range(self.task.num_layers))
            self._queued = rest
            return self._pass(again, range(probe.last_layer + 1))
        assert set(chosen) <= set(probe.positions)
        return rest if rest.layers else None

    def _refine(self, logits: torch.Tensor | None) -> Pass | None:
        """Another round of the policy's, after a pass through every layer."""
        assert self.recomputed is not None
        more = self.policy.refine(self.task, logits) if logits is not None else None
        if not more:
            return self._fall_back(logits)
        assert set(more) <= set(self.task.plan.positions(SpanKind.SPLICED))
        self.recomputed = _union(self.recomputed, more)
        assert len(self.recomputed) <= self.task.budget
        return self._pass(_union(self._compute, more), range(self.task.num_layers))

    def _fall_back(self, logits: torch.Tensor | None) -> Pass | None:
        """Once the policy is done: where its first token leads the runner-up by less than the fallback
        margin, one more pass recomputes every stale token, with the computed ones, from the first layer.
        That gives a full prefill's KV and logits where the rest is exact: lead KV after the same head,
        a cached prefix under plain ids (a prefix hit under segment keys may hold an earlier request's
        spliced KV: the pass recomputes it, `RepairTask.inherited`, where admission copied it into the
        request's own blocks, and leaves it as it is where memory was too short to). A near-tie is
        where repair flips first tokens: the full prefill is torn there too, and agreeing with it takes
        KV all but exact (docs/fidelity.md)."""
        margin = self.task.fallback_margin
        assert self.recomputed is not None
        if not margin or logits is None or self.fell_back or top_margin(logits) >= margin:
            return None
        stale = [*self.task.inherited, *self.task.plan.stale()]
        if set(stale) <= set(self.recomputed):
            return None  # already exact
        self.fell_back = True
        self.spliced_logits = logits.clone()
        self.fallback_tokens = len(set(stale) - set(self.recomputed))
        self.recomputed = _union(self.recomputed, stale)
        return self._pass(_union(self._compute, stale), range(self.task.num_layers))

    def _pass(self, positions: tuple[int, ...], layers: range, observer: LayerObserver | None = None) -> Pass:
        """A pass, with the segment shift where it recomputes spliced tokens (repair/shift.py). The
        passes of one layer run in the order they are made (a later one's layers never precede an
        earlier one's), so what earlier passes recomputed on a layer is known here."""
        recomputed = [p for p in positions if p in self._spliced]
        shift = None
        if self.task.shift and recomputed and self._segments:
            fresh = {layer: frozenset(self._fresh[layer]) for layer in layers}
            shift = SegmentShift(self.task.shift, self._segments, own=frozenset(positions), fresh=fresh)
        for layer in layers:
            self._fresh[layer].update(recomputed)
        return Pass(positions, layers, observer, shift)


def _union(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted({*a, *b}))
