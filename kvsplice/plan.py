"""The plan of one prefill: which prompt tokens reuse KV exactly, which reuse moved KV, which are computed.

The plan is data: it can be printed, tested and compared without running the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class SpanKind(Enum):
    # Cached KV valid as is (an exact cached prefix).
    EXACT = "exact"
    # Cached KV computed in another context: moved to these positions, then repaired.
    SPLICED = "spliced"
    # No KV yet: computed.
    COMPUTE = "compute"


@dataclass(frozen=True)
class Span:
    kind: SpanKind
    start: int
    end: int
    # For SPLICED spans: the index of the reused segment, and where in it the span starts.
    segment: int | None = None
    segment_offset: int = 0
    # For SPLICED spans: the segment was found without markup (reuse/discover.py), not marked.
    discovered: bool = False
    # For SPLICED spans: the KV is the segment's lead KV computed after the very tokens before it here,
    # so it is a full prefill's (reuse/path.py).
    lead_kv: bool = False

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    num_tokens: int
    spans: tuple[Span, ...]
    # The question starts no earlier than this: where the prompt's last marked segment ends (a document
    # new to the store after the last reused one is computed, but it is a document, not the question).
    question_from: int = 0
    # Tokens of found segments computed at their heads instead of spliced (make_plan's `head`): repair
    # spent before the policy chooses, so the policy's budget is the smaller by them.
    heads: int = 0

    def __post_init__(self) -> None:
        assert 0 <= self.question_from < self.num_tokens, f"question from {self.question_from}"
        position = 0
        for span in self.spans:
            assert span.start == position and span.end > span.start, f"spans must tile the prompt: {self}"
            position = span.end
        assert position == self.num_tokens, f"spans cover {position} of {self.num_tokens} tokens"
        assert self.spans[-1].kind is SpanKind.COMPUTE, "the last prompt token is always computed"

    def tokens(self, kind: SpanKind) -> int:
        return sum(len(s) for s in self.spans if s.kind is kind)

    def positions(self, kind: SpanKind) -> list[int]:
        return [p for s in self.spans if s.kind is kind for p in range(s.start, s.end)]

    def spliced(self) -> list[Span]:
        return [s for s in self.spans if s.kind is SpanKind.SPLICED]

    def stale(self) -> list[int]:
        """The spliced positions whose KV is approximate: all but those spliced from lead KV computed
        after the very tokens before them (a full prefill's KV, which repair would only compute again)."""
        return [p for s in self.spliced() if not s.lead_kv for p in range(s.start, s.end)]

    def question(self) -> tuple[int, ...]:
        """The computed tokens after the last spliced one and from `question_from` on (never empty: the
        last prompt token is computed): what a query-aware repair probes with and runs again."""
        spliced = self.spliced()
        start = max(self.question_from, spliced[-1].end if spliced else 0)
        return tuple(p for p in self.positions(SpanKind.COMPUTE) if p >= start)

    @property
    def discovered_tokens(self) -> int:
        """Spliced tokens of segments found without markup."""
        return sum(len(s) for s in self.spliced() if s.discovered)

    @property
    def lead_tokens(self) -> int:
        """Spliced tokens whose KV is a lead KV computed after the very tokens before it (exact)."""
        return sum(len(s) for s in self.spliced() if s.lead_kv)

    def __str__(self) -> str:
        return " ".join(
            f"{s.kind.value}{'(found)' if s.discovered else ''}[{s.start}:{s.end})" for s in self.spans
        )


def make_plan(
    num_tokens: int,
    prefix_hit: int,
    segments: list[tuple[int, int, int]],
    discovered: frozenset[int] = frozenset(),
    question_from: int = 0,
    head: int = 0,
    lead_kv: frozenset[int] = frozenset(),
) -> Plan:
    """segments: (start, end, index) of each reused segment whose KV the store holds, in prompt order,
    not overlapping; `discovered`: the indices of those found without markup; `question_from`: where
    the prompt's last marked segment ends (capped at the last token); `head`: the first tokens of each
    discovered segment that are computed instead (reuse/discover.py says why); `lead_kv`: the indices
    of those whose KV is their lead KV computed after the prompt's own head.

    The exact prefix wins where it overlaps a segment; a segment is cut short before the last token.
    """
    assert 0 <= prefix_hit < num_tokens, f"prefix hit {prefix_hit} of {num_tokens} tokens"
    spans: list[Span] = []
    heads = 0
    if prefix_hit:
        spans.append(Span(SpanKind.EXACT, 0, prefix_hit))
    position = prefix_hit
    for start, end, index in segments:
        lo, hi = max(start, position), min(end, num_tokens - 1)
        if index in discovered and lo < hi:
            heads += min(head, hi - lo)
            lo += head
        if lo >= hi:
            continue
        if lo > position:
            spans.append(Span(SpanKind.COMPUTE, position, lo))
        spans.append(
            Span(
                SpanKind.SPLICED,
                lo,
                hi,
                index,
                segment_offset=lo - start,
                discovered=index in discovered,
                lead_kv=index in lead_kv,
            )
        )
        position = hi
    spans.append(Span(SpanKind.COMPUTE, position, num_tokens))
    return Plan(num_tokens, tuple(spans), min(question_from, num_tokens - 1), heads)
