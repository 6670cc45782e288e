"""The reuse path's entry point: from an admitted prompt to the prefill work that gives it KV.

    prepare(prompt, ...)   look up the prompt's segments in the store, plan the spans, place the
                           stored KV of spliced spans at their new positions, and ask the repair
                           policy what to recompute: returns a `Prefill` (the plan, the work, and
                           what was decided once the work is done)

A segment the pool's store lacks is first asked of the tiers below it (disk, Redis: lower_tiers.py);
a hit there is promoted into the pool's store and spliced like any other. Segments no tier holds are
computed in place with the rest of the prompt (exact for this request) and listed in
`Prefill.missed`, for the engine to store in the background.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvsplice.cache.segments import SegmentEntry, SegmentStore
from kvsplice.kv.pool import KVPool
from kvsplice.models.runner import ModelRunner
from kvsplice.options import RepairSettings
from kvsplice.prompt import ParsedPrompt
from kvsplice.repair.base import RepairPolicy, RepairTask
from kvsplice.repair.registry import budget_tokens, make_policy
from kvsplice.reuse.lower_tiers import LowerTiers, Promotion
from kvsplice.reuse.place import move_kv
from kvsplice.reuse.plan import Plan, Span, SpanKind, make_plan
from kvsplice.reuse.work import Pass, PrefillWork


class RepairRun:
    """The passes a repair policy asks for: one, or a probe pass and then the chosen tokens' rest."""

    def __init__(self, policy: RepairPolicy, task: RepairTask) -> None:
        self.policy = policy
        self.task = task
        plan, layers = task.plan, task.num_layers
        spliced = set(plan.positions(SpanKind.SPLICED))
        self._compute = plan.positions(SpanKind.COMPUTE)
        self.decision = policy.decide(task)
        probe = self.decision.probe
        if probe is None:
            assert set(self.decision.recompute) <= spliced, "a policy recomputes only spliced tokens"
            assert len(self.decision.recompute) <= task.budget or policy.exact, (
                f"{policy.name} recomputes {len(self.decision.recompute)} > {task.budget}"
            )
            self.recomputed: tuple[int, ...] | None = self.decision.recompute
            self.first = Pass(_union(self._compute, self.decision.recompute), range(layers))
        else:
            assert set(probe.positions) <= spliced and 0 <= probe.last_layer < layers
            self.recomputed = None
            self.first = Pass(
                _union(self._compute, probe.positions), range(probe.last_layer + 1), probe.observer
            )

    def next_pass(self, logits: torch.Tensor | None) -> Pass | None:
        probe = self.decision.probe
        if self.recomputed is not None:
            return self._refine(logits)
        assert probe is not None
        chosen = self.policy.choose(self.task, probe, logits)
        assert len(chosen) <= self.task.budget
        self.recomputed = chosen
        if not probe.resume:
            assert set(chosen) <= set(self.task.plan.positions(SpanKind.SPLICED))
            return Pass(_union(self._compute, chosen), range(self.task.num_layers))
        assert set(chosen) <= set(probe.positions)
        if probe.last_layer + 1 == self.task.num_layers:
            return None
        return Pass(_union(self._compute, chosen), range(probe.last_layer + 1, self.task.num_layers))

    def _refine(self, logits: torch.Tensor | None) -> Pass | None:
        """Another round of the policy's, after a pass through every layer."""
        assert self.recomputed is not None
        more = self.policy.refine(self.task, logits) if logits is not None else None
        if not more:
            return None
        assert set(more) <= set(self.task.plan.positions(SpanKind.SPLICED))
        self.recomputed = _union(self.recomputed, more)
        assert len(self.recomputed) <= self.task.budget
        return Pass(_union(self._compute, more), range(self.task.num_layers))


@dataclass(frozen=True)
class MissedSegment:
    """A prompt segment the store lacked; this prefill computes it in place at positions start.."""

    tokens: tuple[int, ...]
    start: int


@dataclass
class Prefill:
    plan: Plan
    budget: int
    work: PrefillWork
    repair: RepairRun
    # Each segment the store lacked and this prefill computes whole (none of it in the cached prefix).
    missed: tuple[MissedSegment, ...]
    # Segments found below the pool and promoted into it for this prefill.
    promoted: tuple[Promotion, ...] = ()

    @property
    def recomputed(self) -> int:
        assert self.repair.recomputed is not None, "known once the probe pass has run"
        return len(self.repair.recomputed)

    @property
    def exact_until(self) -> int | None:
        """The first position whose KV is approximate (a spliced token not recomputed: it and every later
        token read stale KV); None if all KV is exact. Known once the work is done."""
        assert self.repair.recomputed is not None
        stale = sorted(set(self.plan.positions(SpanKind.SPLICED)) - set(self.repair.recomputed))
        return stale[0] if stale else None


class ReusePath:
    def __init__(
        self, runner: ModelRunner, pool: KVPool, store: SegmentStore, lower: LowerTiers | None = None
    ) -> None:
        self.runner = runner
        self.pool = pool
        self.store = store
        self.lower = lower

    def prepare(
        self,
        prompt: ParsedPrompt,
        namespace: Hashable,
        settings: RepairSettings,
        block_table: Sequence[int],
        prefix_hit: int,
    ) -> Prefill:
        """Plan, place and set up the repair of a prompt whose first `prefix_hit` tokens hold exact cached
        KV in `block_table` (which has room for every prompt token)."""
        n = len(prompt.token_ids)
        wanted = {
            index: prompt.segment_tokens(span)
            for index, span in enumerate(prompt.segments)
            if span.end > prefix_hit and span.start < n - 1
        }
        # Promotions allocate, which may evict entries: all of them first, then the lookups, whose
        # entries stay valid until _place is done.
        promoted = self._promote(namespace, list(wanted.values()))
        entries: dict[int, SegmentEntry] = {}
        available: list[tuple[int, int, int]] = []
        missed: list[MissedSegment] = []
        for index, tokens in wanted.items():
            span = prompt.segments[index]
            entry = self.store.lookup(namespace, tokens)
            if entry is not None:
                entries[index] = entry
                available.append((span.start, span.end, index))
            elif span.start >= prefix_hit and all(m.tokens != tokens for m in missed):
                missed.append(MissedSegment(tokens, span.start))
        plan = make_plan(n, prefix_hit, available)
        for spliced in plan.spliced():
            assert spliced.segment is not None
            self._place(block_table, spliced, entries[spliced.segment])
        policy = make_policy(settings.policy)
        reused = plan.tokens(SpanKind.SPLICED)
        budget = budget_tokens(reused, settings.ratio, settings.tokens) if policy.budgeted else reused
        run = RepairRun(
            policy, RepairTask(plan, budget, self.runner.num_layers, self.runner.cfg, settings.target)
        )
        work = PrefillWork(
            block_table,
            prompt.token_ids,
            run.first,
            self.runner.num_layers,
            need_logits=True,
            next_pass=run.next_pass,
        )
        return Prefill(plan, budget, work, run, tuple(missed), promoted)

    def _promote(self, namespace: Hashable, segments: list[tuple[int, ...]]) -> tuple[Promotion, ...]:
        """Load the segments the pool's store lacks from the tiers below, where they hold them."""
        if self.lower is None:
            return ()
        promoted = []
        for tokens in dict.fromkeys(segments):
            if not self.store.contains(namespace, tokens):
                hit = self.lower.promote(namespace, tokens)
                if hit is not None:
                    promoted.append(hit)
        return tuple(promoted)

    def _place(self, table: Sequence[int], span: Span, entry: SegmentEntry) -> None:
        """Move a stored segment's KV (from its token span.segment_offset on) to the span's positions."""
        device = self.pool.device
        local = torch.arange(span.end - span.start, device=device) + span.segment_offset
        dst_pos = torch.arange(span.start, span.end, device=device)
        src = self.pool.slots(entry.blocks, local)
        dst = self.pool.slots(list(table), dst_pos)
        delta = dst_pos - self.store.start_position - local
        move_kv(self.pool, self.runner.cfg, self.runner.freqs, src, dst, delta)


def _union(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted({*a, *b}))
