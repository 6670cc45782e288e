"""Reuse without markup: the spans of a plain prompt that earlier prompts carried, as segments.

    finder.find(namespace, token_ids, covered)   -> Discovery(reused, new)
    finder.remember(namespace, token_ids)        the prompt joins the history later prompts are searched in

Two span indexes (reuse/span_index.py), each per namespace, so tenants with different salts never meet:
- `stored`: every entry of the segment store (marked segments and discovered spans alike), kept in step
  with the store through its watcher hooks. A stretch of the prompt found here reuses that entry's KV
  from the matched offset on, so a discovered span need not be a whole entry, nor an entry a whole
  passage: passages that sat side by side when stored are found one by one when they come apart.
- `seen`: earlier prompts, the newest up to `history_tokens` tokens, each as far as the prefix cache
  keeps its KV under its token ids (the engine passes that part). A stretch found here and not in
  the store is content seen for the second time. Its KV is where the earlier prompt left it, in the
  prefix cache (exact, for that prompt): the request moves it from there, like a stored segment, and
  the engine then copies it into the store (segment_kv.capture_in_place), so the second sighting
  already reuses it and later ones find it even once the prefix cache has let go. Where the prefix
  cache no longer holds it, the request computes it in place and the store keeps that. Storing on
  the second sighting keeps content that never recurs (questions, one-off documents) out of the pool.

Only what no other reuse claims is searched: the caller passes the cached prefix and the marked
segments as `covered`, so the prefix cache wins where the prefix matches and markup where it is given.
Every span found is token for token equal to its source (the index verifies each hit), so a
fingerprint collision never splices the wrong KV.

Seams: a passage pasted into plain text may tokenise differently at its edges, beside other neighbours;
the index simply stops where tokens differ. What it may also do is run past the passage where two
prompts' neighbours agree by chance (a separator, a common first word). A new span is therefore cut
`seam_tokens` inside at each end before it is stored, so an entry holds the passage's interior, which
tokenises the same in any surroundings; a match against the store is used as found.

The prompt's last `tail_tokens` tokens are never in a found span. That is where a plain prompt puts
its question or the framing of an agent's step, often words other prompts carried too: found, they
would be spliced, and the answer would be computed from moved KV. Kept out, they are computed, as the
tokens after the last marked segment are, and the query-aware repair probes with them.

The first `head_tokens` of a found span are computed too, not spliced (the plan makes them so:
plan.py; the span is found, keyed and stored whole). A found span starts where the prompt and
the content it was found in stop agreeing, so its first tokens are the ones whose stored KV followed
other text, and where a marked segment starts at a document, a found span starts wherever the common
text does, often in framing that recurs with the passage (an agent's tool-call line recurs with its
result). Spliced, those tokens were where the answer went wrong, and the next step, which takes that
KV as its prefix, inherited it. Once the head is computed a short tail suffices: the framing after an
agent's last tool output is a few tokens, and a longer tail only computes the end of the passage. The
heads are repair spent before the policy chooses, so they come out of its budget (Plan.heads).
docs/design.md has the measurements that chose the tail and the head.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Sequence
from typing import NamedTuple, cast

from kvsplice.reuse.span_index import SpanIndex


class FoundSpan(NamedTuple):
    """Prompt tokens [start, end) equal the store entry `tokens` from `offset` on."""

    start: int
    end: int
    tokens: tuple[int, ...]
    offset: int


class SeenSpan(NamedTuple):
    """Prompt tokens [start, end) equal the last end - start tokens of `earlier`, the start of an
    earlier prompt (whose KV the prefix cache may still hold)."""

    start: int
    end: int
    earlier: list[int]


class Discovery(NamedTuple):
    # Spans whose KV the store holds, in prompt order.
    reused: list[FoundSpan]
    # Spans seen in an earlier prompt that the store lacks, in prompt order.
    new: list[SeenSpan]


# The shortest span found without markup that is spliced: the span index finds every span this long,
# and unrelated texts share only far shorter runs (docs/design.md).
MIN_SPAN_TOKENS = 64


class SpanFinder:
    def __init__(
        self,
        min_tokens: int,
        history_tokens: int,
        seam_tokens: int = 2,
        tail_tokens: int = 8,
        head_tokens: int = 16,
    ) -> None:
        """min_tokens: the shortest span spliced (the engine's: MIN_SPAN_TOKENS).
        history_tokens: the most tokens of earlier prompts kept to search in (~9 bytes each).
        tail_tokens: the prompt's last tokens, always computed (at least the last one).
        head_tokens: the first tokens of each found span, computed instead of spliced."""
        assert tail_tokens >= 1, "the last prompt token is always computed"
        self.min_tokens = min_tokens
        self.history_tokens = history_tokens
        self.seam_tokens = seam_tokens
        self.tail_tokens = tail_tokens
        self.head_tokens = head_tokens
        self.stored = SpanIndex()
        self.seen = SpanIndex()
        # Handles of remembered prompts, oldest first, with their lengths.
        self._history: deque[tuple[int, int]] = deque()
        self._ids = itertools.count()

    # -- the segment store's watcher hooks --------------------------------------------------------

    def inserted(self, namespace: Hashable, tokens: tuple[int, ...]) -> None:
        self.stored.add(namespace, (namespace, tokens), tokens)

    def evicted(self, namespace: Hashable, tokens: tuple[int, ...]) -> None:
        self.stored.remove((namespace, tokens))

    # -- prompts ------------------------------------------------------------------------------------

    def find(
        self, namespace: Hashable, token_ids: Sequence[int], covered: Sequence[tuple[int, int]]
    ) -> Discovery:
        """Spans of at least min_tokens outside `covered` ((start, end) pairs) and the prompt's last
        tail_tokens. Changes nothing."""
        n = len(token_ids)
        tail = (max(0, n - self.tail_tokens), n)
        gaps = _gaps([*covered, tail], n, self.min_tokens)
        reused: list[FoundSpan] = []
        for lo, hi in gaps:
            for m in self.stored.find(namespace, token_ids[lo:hi], self.min_tokens):
                _, tokens = cast(tuple[Hashable, tuple[int, ...]], m.source)  # the store's key
                reused.append(FoundSpan(lo + m.start, lo + m.end, tokens, m.source_start))
        new: list[SeenSpan] = []
        cut = self.seam_tokens
        for lo, hi in _gaps([*covered, tail, *((s.start, s.end) for s in reused)], n, self.min_tokens):
            for m in self.seen.find(namespace, token_ids[lo:hi], self.min_tokens):
                # A span that starts or ends at the gap's edge meets other reuse there, not a seam.
                start = lo + m.start + (cut if m.start > 0 else 0)
                end = lo + m.end - (cut if lo + m.end < hi else 0)
                if end - start >= self.min_tokens:
                    earlier = self.seen.source_tokens(m.source, m.source_start + end - (lo + m.start))
                    new.append(SeenSpan(start, end, earlier))
        return Discovery(reused, new)

    def remember(self, namespace: Hashable, token_ids: Sequence[int]) -> None:
        """Keep the prompt to search later prompts in; the oldest go beyond history_tokens."""
        if len(token_ids) < self.min_tokens:
            return
        handle = next(self._ids)
        self.seen.add(namespace, handle, token_ids)
        self._history.append((handle, len(token_ids)))
        while self.seen.num_tokens > self.history_tokens and len(self._history) > 1:
            old, _ = self._history.popleft()
            self.seen.remove(old)


def _gaps(covered: Sequence[tuple[int, int]], n: int, min_len: int) -> list[tuple[int, int]]:
    """The stretches of [0, n) outside every covered (start, end), of at least min_len tokens."""
    gaps = []
    position = 0
    for start, end in sorted(covered):
        if start - position >= min_len:
            gaps.append((position, start))
        position = max(position, end)
    if n - position >= min_len:
        gaps.append((position, n))
    return gaps
