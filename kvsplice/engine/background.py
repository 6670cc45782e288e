"""The engine's background work for the segment store, and audits: every token of it counted
(computed_tokens; audit_tokens of it the audits').

    queue(namespace, block_table, prefill)   after a prefill's last chunk: what it missed, and the spans
                                             it moved from earlier prompts, are queued
    pending_kv()                             where each queued segment's KV is until it is copied
    copy(segments)                           copy queued captures into the store, segment by segment (tens
                                             of milliseconds each), and let go of the blocks held for them;
                                             each goes to the tiers below at once
    fill(tokens)                             one chunk of a stored segment computed after another
                                             context (segment_kv.CONTEXTS) or at a prompt's start (lead
                                             KV), or of the canonical context (once, before the first
                                             context sample)

Quality work is paid only where reuse pays it back. A segment seen once costs its in-place prefill
and a copy: its KV is the prompt's, and if it opened that prompt its lead KV is copied from there too.
Its other contexts are computed once it is seen again (a prefill splices it), and its lead KV once a
prompt opens with it and finds none.

None of it runs in a step with a prefill in it or a request waiting (the scheduler leaves no
background budget there), so no first token waits for another request's store work. A request
admitted while a copy is queued moves the segment's KV from the blocks of the request that computed it,
which is what the copy would give it. Copies run in steps the engine has to spare, one segment a step
whatever the budget (Engine.step), so a request that arrives meanwhile waits for one segment's copy
at most; or all at once when the head of the queue waits for the memory they hold.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from kvsplice.cache.segments import SegmentStore
from kvsplice.engine.audit import AuditFill
from kvsplice.kv.pool import KVPool
from kvsplice.models.runner import ModelRunner
from kvsplice.plan import SpanKind
from kvsplice.reuse.lower_tiers import LowerTiers
from kvsplice.reuse.path import MissedSegment, PendingKV, Prefill
from kvsplice.reuse.segment_kv import (
    CanonicalContextFill,
    ContextSample,
    LeadFill,
    capture_in_place,
    capture_lead_in_place,
)
from kvsplice.reuse.work import PrefillWork

Fill = ContextSample | CanonicalContextFill | LeadFill | AuditFill


@dataclass(frozen=True)
class _Copy:
    """A segment a prefill computed in place (or moved from an earlier prompt) and the store lacks: its
    KV at positions segment.start.. of `blocks`, on each of which a reference is held until the last
    segment of those blocks is copied (`release`)."""

    namespace: Hashable
    blocks: list[int]
    segment: MissedSegment
    release: bool
    # The head of the prompt that carried it (path.lead_head), and whether the segment opened that
    # prompt right after it with exact KV before and in it: its KV in place is then its lead KV,
    # copied with it (the head's KV from the slots before it) instead of computed again.
    head: tuple[int, ...]
    lead_in_place: bool = False


class BackgroundWork:
    def __init__(
        self,
        store: SegmentStore,
        pool: KVPool,
        runner: ModelRunner,
        lower: LowerTiers | None,
        segment_contexts: int = 1,
        segment_lead_kv: bool = False,
    ) -> None:
        self.store = store
        self.pool = pool
        self.runner = runner
        self.lower = lower
        self.segment_contexts = segment_contexts
        self.segment_lead_kv = segment_lead_kv
        self._copies: deque[_Copy] = deque()
        # Stored segments to compute after another context or at a prompt's start, or the canonical
        # context; the one being computed.
        self._fills: deque[Fill] = deque()
        # Segments seen again while their copy into the store was queued: their contexts follow it.
        self._recurring: set[tuple[Hashable, tuple[int, ...]]] = set()
        self._filling: tuple[Fill, PrefillWork] | None = None
        self.samples_dropped = 0
        self.leads_dropped = 0
        # What the fills computed: query tokens through every layer, and FLOPs; of it, the audits'.
        self.computed_tokens = 0
        self.computed_flops = 0.0
        self.audit_tokens = 0
        self.audit_flops = 0.0

    @property
    def busy(self) -> bool:
        return bool(self._copies or self._fills) or self._filling is not None

    @property
    def queued(self) -> int:
        """Store jobs not done yet: copies, fills and samples queued, and the one being computed."""
        return len(self._copies) + len(self._fills) + (self._filling is not None)

    @property
    def holds_blocks(self) -> bool:
        """Queued copies hold blocks that copy() gives back."""
        return bool(self._copies)

    def queue(
        self, namespace: Hashable, block_table: list[int], prefill: Prefill, head: tuple[int, ...] = ()
    ) -> None:
        """The store work a finished prefill leaves: its borrowed spans and missed segments, the lead KV
        of segments promoted from the tiers below (which hold the mean KV only), and that of stored
        segments that open the prompt but lost their lead KV for memory. `head`: the prompt's
        head, which the lead KV of its segments is computed after (prefill.lead_head; empty: BOS)."""
        for promoted in prefill.promoted:
            self._lead(promoted.namespace, promoted.tokens, head)
        for tokens in prefill.lead_missing:
            self._lead(namespace, tokens, head)
        for tokens in prefill.recurring:
            self._recurred(namespace, tokens)
        for b in prefill.borrowed:
            # Copied from the earlier prompt's KV, whose blocks the prefill has held since it was planned.
            self._copies.append(
                _Copy(namespace, b.blocks, MissedSegment(b.tokens, b.start), release=True, head=head)
            )
        if not prefill.missed:
            return
        # Hold the request's blocks up to the last missed token until the copy: the request may
        # finish, and release them, in this very step.
        last = max(m.start + len(m.tokens) for m in prefill.missed)
        blocks = block_table[: -(-last // self.pool.block_size)]
        self.pool.allocator.incref(blocks)
        # The KV before a missed segment is this request's own where its prefix hit ends before it (a hit
        # under segment keys may hold another request's spliced KV), and exact up to `exact`.
        exact, own_from = prefill.exact_until, prefill.plan.tokens(SpanKind.EXACT)
        for i, missed in enumerate(prefill.missed):
            release = i == len(prefill.missed) - 1
            end = missed.start + len(missed.tokens)
            in_place = (
                bool(head)
                and missed.start == len(head)
                and own_from <= missed.start
                and (exact is None or exact >= end)
            )
            self._copies.append(_Copy(namespace, blocks, missed, release, head, in_place))

    def audit(self, fill: AuditFill) -> None:
        """Queue an audit: a spliced request's prompt prefilled in full (engine/audit.py)."""
        self._fills.append(fill)

    def audit_now(self, fill: AuditFill) -> None:
        """Run an audit at once (a request that asked for its own), counted with the background work."""
        work = fill.start()
        if work is None:
            return
        logits = None
        while not work.done:
            logits = self._run(work, len(fill.token_ids), audit=True)
        self._audited(fill, logits)

    def pending_kv(self) -> dict[tuple[Hashable, tuple[int, ...]], PendingKV]:
        """Where each segment whose copy is queued has its KV: in the blocks of the request that computed
        it, at the positions it had there (the first queued copy of a segment)."""
        found: dict[tuple[Hashable, tuple[int, ...]], PendingKV] = {}
        for c in self._copies:
            found.setdefault((c.namespace, c.segment.tokens), PendingKV(c.blocks, c.segment.start))
        return found

    def copy(self, segments: int | None = None) -> int:
        """Copy the first `segments` queued segments' KV (None: all) into the store, in order, letting go
        of the blocks held for them. Returns how many were copied."""
        runner, done = self.runner, 0
        while self._copies and (segments is None or done < segments):
            c = self._copies.popleft()
            m = c.segment
            captured = capture_in_place(
                self.store, self.pool, runner.cfg, runner.freqs, c.namespace, m.tokens, c.blocks, m.start
            )
            if captured:
                if c.lead_in_place and self._keeps_lead:
                    capture_lead_in_place(self.store, self.pool, c.namespace, m.tokens, c.head, c.blocks)
                self._stored(c.namespace, m.tokens)
            self._recurring.discard((c.namespace, m.tokens))
            if c.release:
                self.pool.allocator.decref(reversed(c.blocks))
            done += 1
        return done

    def fill(self, tokens: int) -> None:
        """One chunk of store-filling work, at most `tokens` long."""
        while self._filling is None and self._fills:
            fill = self._fills.popleft()
            work = fill.start()
            if work is None:
                if isinstance(fill, LeadFill):
                    self.leads_dropped += self.store.contains(fill.namespace, fill.tokens)
                elif isinstance(fill, ContextSample):
                    self.samples_dropped += 1
                    self._sampled(fill)
                continue
            self._filling = (fill, work)
        if self._filling is None:
            return
        fill, work = self._filling
        logits = self._run(work, tokens, audit=isinstance(fill, AuditFill))
        if work.done:
            if isinstance(fill, AuditFill):
                self._audited(fill, logits)
            else:
                fill.finish()
            self._filling = None
            if isinstance(fill, ContextSample):
                self._sampled(fill)

    def _run(self, work: PrefillWork, tokens: int, audit: bool) -> torch.Tensor | None:
        """Run the next chunk of a fill's work, at most `tokens` long, and count it."""
        chunk = work.next_chunk(tokens)
        result = self.runner.forward(chunk)
        self._count(len(chunk.positions), result.flops, audit)
        return work.complete(chunk, result)

    def _audited(self, fill: AuditFill, logits: torch.Tensor | None) -> None:
        """An audit's prefill is done: compare, and count the answer's decoding it did."""
        fill.finish(logits)
        self._count(fill.decoded_tokens, fill.decoded_flops, audit=True)

    def _count(self, tokens: int, flops: float, audit: bool) -> None:
        self.computed_tokens += tokens
        self.computed_flops += flops
        if audit:
            self.audit_tokens += tokens
            self.audit_flops += flops

    @property
    def _keeps_lead(self) -> bool:
        """Lead KV is kept where the engine keeps it and the store has a context (a model with a
        tokenizer)."""
        return self.segment_lead_kv and bool(self.store.context)

    def _stored(self, namespace: Hashable, tokens: tuple[int, ...]) -> None:
        """A segment entered the store with its KV from the prompt that carried it: it goes to the tiers
        below at once (they hold one KV per segment, not the lead KV), and where it was seen again
        meanwhile (its copy was still queued), its other contexts are queued."""
        self._write_through(namespace, tokens)
        if (namespace, tokens) in self._recurring:
            self._contexts(namespace, tokens)

    def _recurred(self, namespace: Hashable, tokens: tuple[int, ...]) -> None:
        """A prefill spliced a stored segment (or one whose copy is queued): seen twice, it is worth
        computing after more contexts. A segment seen once costs its in-place prefill and no more."""
        if self.store.contains(namespace, tokens):
            self._contexts(namespace, tokens)
        elif any(c.namespace == namespace and c.segment.tokens == tokens for c in self._copies):
            self._recurring.add((namespace, tokens))

    def _contexts(self, namespace: Hashable, tokens: tuple[int, ...]) -> None:
        """Queue a stored segment's other contexts, unless it has them or they are queued. Without a
        canonical context (a model without a tokenizer) there is no context to vary."""
        entry = self.store.peek(namespace, tokens)
        assert entry is not None
        if self.segment_contexts == 1 or not self.store.context or entry.contexts > 1:
            return
        if self._queued(ContextSample, namespace, tokens):
            return
        if self.store.context_blocks is None and not any(
            isinstance(f, CanonicalContextFill) for f in self._fills
        ):
            # Dropped when memory is short: the samples then compute their canonical text, and the
            # next stored segment queues it again.
            self._fills.appendleft(CanonicalContextFill(self.store, self.pool, self.runner.num_layers))
        for index in range(1, self.segment_contexts):
            self._fills.append(
                ContextSample(
                    self.store, self.pool, self.runner.cfg, self.runner.freqs, namespace, tokens, index
                )
            )

    def _lead(self, namespace: Hashable, tokens: tuple[int, ...], head: tuple[int, ...]) -> None:
        """Queue a stored segment's lead KV, computed after `head` (empty: the canonical context's first
        token, BOS), where the engine keeps lead KV and the store has a context (a model with a
        tokenizer). Not twice: prompts admitted together that open with the same segment each report
        it missing, and a second fill would only be dropped, after inflating the queue."""
        if self._keeps_lead and not self._queued(LeadFill, namespace, tokens):
            head = head or self.store.context[:1]
            self._fills.append(
                LeadFill(self.store, self.pool, self.runner.num_layers, namespace, tokens, head)
            )

    def _queued(
        self, kind: type[ContextSample] | type[LeadFill], namespace: Hashable, tokens: tuple[int, ...]
    ) -> bool:
        """Whether a fill of `kind` for the segment is queued or being computed."""
        filling = () if self._filling is None else (self._filling[0],)
        return any(
            isinstance(f, kind) and (f.namespace, f.tokens) == (namespace, tokens)
            for f in (*self._fills, *filling)
        )

    def _sampled(self, sample: ContextSample) -> None:
        """A context sample is done or dropped: after the last, the segment's mean KV replaces the
        in-place KV the tiers below were given when it was stored."""
        if sample.index == self.segment_contexts - 1:
            self._write_through(sample.namespace, sample.tokens)

    def _write_through(self, namespace: Hashable, tokens: tuple[int, ...]) -> None:
        if self.lower is not None and self.store.contains(namespace, tokens):
            self.lower.write_through(namespace, tokens)
