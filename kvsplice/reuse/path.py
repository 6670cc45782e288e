"""The reuse path's entry point: from an admitted prompt to the prefill work that gives it KV.

    lookup(namespace, prompt, plain_hit)   before admission: the spans the prompt shares with
                           earlier prompts without markup (the span finder runs once per request,
                           here) and whether its first segment has exact lead KV: data that
                           admission keys the request by, and prepare then uses
    prepare(prompt, ...)   look up the prompt's segments in the store, plan the spans, place the
                           stored KV of spliced spans at their new positions, and start the repair
                           policy's run (repair_run.py): returns a `Prefill` (the plan, the work,
                           and what was decided once the work is done)

A segment the pool's store lacks is first asked of the tiers below it (disk, Redis: lower_tiers.py);
a hit there is promoted into the pool's store and spliced like any other. Then of the engine's queued
store copies: a segment an earlier request computed in place, whose copy into the store waits for
idle time, is moved from that request's blocks, as the copy would be (`pending`, which the engine
passes as data). Segments no one
holds, marked or found, are computed in place with the rest of the prompt (exact for this request)
and listed in `Prefill.missed`, for the engine to store after the first token.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvsplice.cache.base import PrefixCache
from kvsplice.cache.segments import SegmentStore
from kvsplice.kv.pool import KVPool
from kvsplice.models.runner import ModelRunner
from kvsplice.options import RepairSettings
from kvsplice.plan import Plan, Span, SpanKind, make_plan
from kvsplice.prompt import ParsedPrompt
from kvsplice.repair.base import RepairTask
from kvsplice.repair.gate import TrustGate, gate_cell, prompt_shape
from kvsplice.repair.registry import budget_tokens, make_policy
from kvsplice.repair.shift import default_shift
from kvsplice.reuse.discover import Discovery, FoundSpan, SeenSpan, SpanFinder
from kvsplice.reuse.lower_tiers import LowerTiers, Promotion
from kvsplice.reuse.place import move_kv
from kvsplice.reuse.repair_run import RepairRun
from kvsplice.reuse.work import PrefillWork


@dataclass(frozen=True)
class MissedSegment:
    """A prompt segment the store lacked; this prefill computes it in place at positions start.."""

    tokens: tuple[int, ...]
    start: int


class PendingKV(NamedTuple):
    """A segment's KV where the request that computed it left it: slots start.. of `blocks` (that
    request's, from its first), computed at positions start.. (held until the engine copies it)."""

    blocks: Sequence[int]
    start: int


@dataclass(frozen=True)
class BorrowedSpan:
    """A found span whose KV this prefill moved from an earlier prompt's blocks in the prefix cache. A
    reference is held on each of `blocks` (the earlier prompt's, from its first) until the engine has
    copied the span into the store."""

    tokens: tuple[int, ...]
    blocks: list[int]
    # The span's position in the earlier prompt.
    start: int


# A marked segment that starts within this many tokens of the prompt's start (after an instruction, a
# system line) is spliced from its lead KV where the store holds it (reuse/segment_kv.LEAD_KV),
# computed after the head of the prompt that stored it: exact after the same head, and after another
# one it misses only those few tokens, where the stored mean KV saw a whole canonical context of other
# content (docs/design.md).
LEAD_HEAD_TOKENS = 64


def lead_head(prompt: ParsedPrompt) -> tuple[int, ...]:
    """The tokens before the prompt's first marked segment, which its segments' lead KV is computed
    after; empty (BOS alone) where they are more than LEAD_HEAD_TOKENS or it marks none."""
    start = prompt.segments[0].start if prompt.segments else 0
    return prompt.token_ids[:start] if start <= LEAD_HEAD_TOKENS else ()


class _KVSource(NamedTuple):
    """Where a reused segment's KV is: slots slot.. of `blocks`, computed at positions position.."""

    blocks: Sequence[int]
    slot: int
    position: int


@dataclass(frozen=True)
class Lookup:
    """What the reuse path found for a prompt before admission, as data: admission keys the request by
    it (cache/segment_keys.py), then `prepare` splices what it found."""

    # Spans found without markup after the plain prefix hit (None: no span finder).
    discovery: Discovery | None
    # Where the prompt's first marked segment ends if the store holds its lead KV computed after this
    # very prompt head (spliced, a full prefill's KV); None otherwise.
    exact_lead: int | None

    @property
    def first_found(self) -> int | None:
        """Where the first span found without markup starts, if any."""
        if self.discovery is None:
            return None
        starts = [s.start for s in self.discovery.reused] + [s.start for s in self.discovery.new]
        return min(starts, default=None)


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
    # Found spans the store lacked, moved from earlier prompts' KV: to store, then to let go of.
    borrowed: tuple[BorrowedSpan, ...] = ()
    # Stored segments that open this prompt but have no lead KV (dropped for memory, or not computed
    # yet: a LeadFill for one that has it by the time it runs does nothing): to compute.
    lead_missing: tuple[tuple[int, ...], ...] = ()
    # Segments this prefill took from the store or from a queued copy, not from a tier below: seen
    # again, so worth the background work that brings their stored KV closer to a full prefill's.
    recurring: tuple[tuple[int, ...], ...] = ()
    # The prompt's coarse shape (repair/gate.py), its cell in the trust gate (the shape under this
    # repair) and the fallback margin the gate set for it (0: none).
    shape: str = ""
    gate_key: str = ""
    gate_margin: float = 0.0
    # The cached prefix holds KV an earlier request spliced that a fallback cannot recompute (in blocks
    # shared with the cache): even a fallback's result is then not a full prefill's.
    approximate_prefix: bool = False

    @property
    def recomputed(self) -> int:
        assert self.repair.recomputed is not None, "known once the probe pass has run"
        return len(self.repair.recomputed)

    @property
    def exact_until(self) -> int | None:
        """The first position whose KV is approximate (a spliced token not recomputed, nor spliced from
        lead KV computed after the very tokens before it: it and every later token read stale KV);
        None if all KV is exact. Known once the work is done."""
        assert self.repair.recomputed is not None
        stale = sorted(set(self.plan.stale()) - set(self.repair.recomputed))
        return stale[0] if stale else None


class ReusePath:
    def __init__(
        self,
        runner: ModelRunner,
        pool: KVPool,
        store: SegmentStore,
        prefix_cache: PrefixCache,
        finder: SpanFinder | None = None,
        lower: LowerTiers | None = None,
        gate: TrustGate | None = None,
    ) -> None:
        """finder: finds reusable spans in prompts without markup (None: only marked segments); their
        KV comes from the store, or from earlier prompts' blocks in `prefix_cache`. lower: the tiers
        below the pool (None: none). gate: the trust gate, which raises a request's fallback margin
        where its prompt's shape needs it (None: the request's own margin only)."""
        self.runner = runner
        self.pool = pool
        self.store = store
        self.prefix_cache = prefix_cache
        self.finder = finder
        self.lower = lower
        self.gate = gate
        # The segment shift of repair: the model family's (repair/shift.py).
        self.shift = default_shift(runner.cfg)
        if finder is not None:
            store.watch(finder)

    def lookup(self, namespace: Hashable, prompt: ParsedPrompt, plain_hit: int) -> Lookup:
        """What admission needs to key the prompt, found before it: spans found without markup where no
        other reuse claims the prompt (not in its first `plain_hit` tokens, the prefix the cache holds
        under plain ids, nor in a marked segment), and the exact lead KV of its first segment."""
        discovery = None
        if self.finder is not None:
            covered = [(0, plain_hit), *((s.start, s.end) for s in prompt.segments)]
            discovery = self.finder.find(namespace, prompt.token_ids, covered)
        return Lookup(discovery, self._exact_lead(namespace, prompt))

    def prepare(
        self,
        prompt: ParsedPrompt,
        namespace: Hashable,
        settings: RepairSettings,
        block_table: Sequence[int],
        prefix_hit: int,
        lookup: Lookup,
        approximate_from: int | None = None,
        own_from: int = 0,
        pending: Mapping[tuple[Hashable, tuple[int, ...]], PendingKV] | None = None,
    ) -> Prefill:
        """Plan, place and set up the repair of a prompt whose first `prefix_hit` tokens hold exact cached
        KV in `block_table` (which has room for every prompt token). `lookup`: what `lookup` found for
        it before admission. `approximate_from`: where the request's segment keys start (None: plain
        ids); nothing before it is spliced, since the prefix cache keeps that KV under plain ids.
        `own_from`: where the request's own blocks start (before it, they are shared with the cache).
        `pending`: where each segment whose copy into the store is queued has its KV."""
        pending = pending or {}
        n = len(prompt.token_ids)
        wanted = {
            index: prompt.segment_tokens(span)
            for index, span in enumerate(prompt.segments)
            if span.end > prefix_hit and span.start < n - 1
        }
        # Promotions allocate, which may evict entries: all of them first, then the lookups, whose
        # entries stay valid until _place is done.
        promoted = self._promote(namespace, list(wanted.values()))
        # Per reused segment: where its KV is.
        sources: dict[int, _KVSource] = {}
        lead_kv: set[int] = set()
        lead_missing: list[tuple[int, ...]] = []
        available: list[tuple[int, int, int]] = []
        missed: list[MissedSegment] = []
        promoted_tokens = {p.tokens for p in promoted}
        recurring: list[tuple[int, ...]] = []
        for index, tokens in wanted.items():
            span = prompt.segments[index]
            entry = self.store.lookup(namespace, tokens)
            queued = pending.get((namespace, tokens)) if entry is None else None
            if (entry is not None or queued is not None) and tokens not in promoted_tokens:
                recurring.append(tokens)
            if entry is not None:
                if entry.lead_blocks is not None and span.start <= LEAD_HEAD_TOKENS:
                    # At the prompt's start: the KV computed there (after a prompt's head).
                    self.store.lead_hit(entry)
                    head = len(entry.lead_head)
                    sources[index] = _KVSource(entry.lead_blocks, head, head)
                    if entry.lead_head == prompt.token_ids[: span.start]:
                        lead_kv.add(index)
                else:
                    sources[index] = _KVSource(entry.blocks, 0, self.store.start_position)
                    if span.start <= LEAD_HEAD_TOKENS and all(p.tokens != tokens for p in promoted):
                        lead_missing.append(tokens)
                available.append((span.start, span.end, index))
            elif queued is not None:
                self.store.count_queued_hit(tokens)
                sources[index] = _KVSource(queued.blocks, queued.start, queued.start)
                available.append((span.start, span.end, index))
            elif all(m.tokens != tokens for m in missed):
                # Also a segment the prefix hit ends inside: under segment keys that hit can run one token
                # into a new segment that starts like a cached one ("The ..."); stored, the next request
                # that carries it splices it.
                missed.append(MissedSegment(tokens, span.start))
        discovered: set[int] = set()
        borrowed: list[BorrowedSpan] = []
        if self.finder is not None:
            assert lookup.discovery is not None
            # Nothing inside the cached prefix, nor before the segment keys start (spliced there, it
            # would put approximate KV under plain ids).
            found = _after(lookup.discovery, max(prefix_hit, approximate_from or 0), self.finder.min_tokens)
            index = len(prompt.segments)
            for reused in found.reused:
                entry = self.store.lookup(namespace, reused.tokens)
                if entry is None:
                    # Evicted since the lookup (admission and promotions allocate): computed instead.
                    continue
                recurring.append(reused.tokens)
                position = self.store.start_position + reused.offset
                sources[index] = _KVSource(entry.blocks, reused.offset, position)
                available.append((reused.start, reused.end, index))
                index += 1
            for seen in found.new:
                tokens = prompt.token_ids[seen.start : seen.end]
                hit = self.prefix_cache.borrow(namespace, seen.earlier)
                if hit.num_tokens < len(seen.earlier):
                    self.pool.allocator.decref(reversed(hit.blocks))
                    if all(m.tokens != tokens for m in missed):
                        missed.append(MissedSegment(tokens, seen.start))
                    continue
                start = len(seen.earlier) - len(tokens)
                borrowed.append(BorrowedSpan(tokens, list(hit.blocks), start))
                sources[index] = _KVSource(hit.blocks, start, start)
                available.append((seen.start, seen.end, index))
                index += 1
            discovered = set(range(len(prompt.segments), index))
        last_segment = prompt.segments[-1].end if prompt.segments else 0
        head = self.finder.head_tokens if self.finder is not None else 0
        plan = make_plan(
            n, prefix_hit, sorted(available), frozenset(discovered), last_segment, head, frozenset(lead_kv)
        )
        self._place(block_table, plan.spliced(), sources)
        policy = make_policy(settings.policy)
        if self.finder is not None and discovered and not policy.exact:
            missed += self._unkept(prompt, plan, missed)
        spliced = plan.tokens(SpanKind.SPLICED)
        # A prefix hit under segment keys that ends past where the keys start holds an earlier request's
        # spliced KV there, repaired for that request. Where it lies in the request's own blocks (copied
        # at admission) a fallback recomputes it; otherwise (no memory to copy it) the prefix stays
        # approximate. Repair leaves it as it is: recomputing a share of it again for the new question
        # did not bring later turns closer to a full prefill (docs/design.md).
        inherited: tuple[int, ...] = ()
        approximate_prefix = approximate_from is not None and prefix_hit > approximate_from
        if approximate_prefix and approximate_from is not None and approximate_from >= own_from:
            inherited, approximate_prefix = tuple(range(approximate_from, prefix_hit)), False
        shape = prompt_shape(plan, len(inherited))
        gate_key = gate_cell(shape, settings.policy, settings.ratio)
        gate_margin = (
            self.gate.margin(gate_key) if self.gate is not None and shape and not policy.exact else 0.0
        )
        # The heads of found spans (plan.heads) were reused tokens: they count toward the budget.
        budget = (
            max(0, budget_tokens(spliced + plan.heads, settings.ratio) - plan.heads)
            if policy.budgeted
            else spliced
        )
        run = RepairRun(
            policy,
            RepairTask(
                plan,
                budget,
                self.runner.num_layers,
                self.runner.cfg,
                self.shift,
                max(settings.fallback_margin, gate_margin),
                inherited,
            ),
        )
        work = PrefillWork(
            block_table,
            prompt.token_ids,
            run.first,
            self.runner.num_layers,
            need_logits=True,
            next_pass=run.next_pass,
        )
        return Prefill(
            plan,
            budget,
            work,
            run,
            tuple(missed),
            promoted=promoted,
            borrowed=tuple(borrowed),
            lead_missing=tuple(lead_missing),
            recurring=tuple(dict.fromkeys(recurring)),
            shape=shape,
            gate_key=gate_key,
            gate_margin=gate_margin,
            approximate_prefix=approximate_prefix,
        )

    def _exact_lead(self, namespace: Hashable, prompt: ParsedPrompt) -> int | None:
        """Where the prompt's first marked segment ends, if the store holds its lead KV computed after
        this very prompt head: spliced, it is a full prefill's KV (unless it is dropped for memory
        before the plan; Request.indexable_len covers that)."""
        if not prompt.segments or prompt.segments[0].start > LEAD_HEAD_TOKENS:
            return None
        span = prompt.segments[0]
        entry = self.store.peek(namespace, prompt.segment_tokens(span))
        if entry is None or entry.lead_blocks is None or entry.lead_head != prompt.token_ids[: span.start]:
            return None
        return span.end

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

    def _unkept(self, prompt: ParsedPrompt, plan: Plan, missed: list[MissedSegment]) -> list[MissedSegment]:
        """Computed stretches after the first spliced token, for the store. Their KV reads approximate
        KV, so the prefix cache (plain token ids) will not keep it; stored, a later prompt that carries
        them finds them there, as it would a marked segment stored at first sight."""
        assert self.finder is not None
        first = plan.spliced()[0].start
        marked = [(s.start, s.end) for s in prompt.segments] + [
            (m.start, m.start + len(m.tokens)) for m in missed
        ]
        # Where each found span starts: its head is computed, so a computed stretch runs into it, but the
        # head's KV is stored with the found span's entry, not again with the stretch.
        found = [s.start - s.segment_offset for s in plan.spliced() if s.discovered]
        kept = []
        for span in plan.spans:
            end = min(span.end, plan.num_tokens - 1, *(f for f in found if f > span.start))
            if (
                span.kind is not SpanKind.COMPUTE
                or span.start < first
                or end - span.start < self.finder.min_tokens
            ):
                continue
            if any(s < end and span.start < e for s, e in marked):
                continue  # a marked segment or a found span, stored on its own
            kept.append(MissedSegment(prompt.token_ids[span.start : end], span.start))
        return kept

    def _place(self, table: Sequence[int], spans: list[Span], sources: dict[int, _KVSource]) -> None:
        """Move each spliced span's KV (its segment's from token span.segment_offset on) to the span's
        positions, all spans in one move: each costs a few small ops per layer, which add up."""
        if not spans:
            return
        device = self.pool.device
        src, dst, delta = [], [], []
        for span in spans:
            assert span.segment is not None
            source = sources[span.segment]
            local = torch.arange(span.end - span.start, device=device) + span.segment_offset
            dst_pos = torch.arange(span.start, span.end, device=device)
            src.append(self.pool.slots(list(source.blocks), local + source.slot))
            dst.append(dst_pos)
            delta.append(dst_pos - source.position - local)
        dst_slots = self.pool.slots(list(table), torch.cat(dst))
        move_kv(self.pool, self.runner.cfg, self.runner.freqs, torch.cat(src), dst_slots, torch.cat(delta))


def _after(discovery: Discovery, start: int, min_tokens: int) -> Discovery:
    """The spans found, cut to begin at `start` or later; a span left shorter than `min_tokens` goes."""
    reused = [
        FoundSpan(max(s.start, start), s.end, s.tokens, s.offset + max(0, start - s.start))
        for s in discovery.reused
        if s.end - max(s.start, start) >= min_tokens
    ]
    # A seen span's KV is the end of `earlier`: cutting its front leaves that as it is.
    new = [
        SeenSpan(max(s.start, start), s.end, s.earlier)
        for s in discovery.new
        if s.end - max(s.start, start) >= min_tokens
    ]
    return Discovery(reused, new)
