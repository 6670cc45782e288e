"""The span index: find where a plain prompt repeats tokens of earlier sequences, wherever they sit.

The engine adds sequences whose KV it holds and asks, for a new prompt, which spans of it are token
for token equal to spans of those sequences. No markup is needed: a RAG prompt that pastes passages an
earlier prompt carried, in another order and between other text, finds them. Plain Python, no tensors:

    index.add(namespace, source, token_ids)        # the engine holds KV of token_ids under `source`
    for m in index.find(namespace, prompt, 64):    # SpanMatch(start, end, source, source_start)
        ...                                        # prompt[m.start:m.end] == token_ids[m.source_start:...]
    index.remove(source)                           # that KV is gone

How. Each source is cut into content-defined chunks (chunking.py) and the index keeps one anchor per
chunk: the fingerprint of the chunk's first `anchor_len` tokens -> (source, offset). `find` looks up
the fingerprint of the `anchor_len` tokens at *every* position of the prompt, checks each hit token
by token (a fingerprint collision is never a match), extends it both ways to the longest common span
with that source, and picks spans greedily by length without overlap.

The guarantee: every span of >= max_len + anchor_len - 1 tokens (`guaranteed_len`) that the prompt
shares with a source is found, whatever surrounds it in either, as long as no position of the prompt
meets more than `max_hits` anchors (it is checked against the newest that many); the spans returned
cover it but for stretches shorter than min_len where a longer span of another source overlaps it
(rare: bench/results/chunking.md). Proof: chunks are at most max_len long, so such a span of
the source holds a chunk start at least anchor_len tokens before its end, and the scan, which reaches
every position of the prompt, meets that anchor. Shorter spans are found when they happen to hold an
anchor. max_hits bounds the work on repetitive text: a run of one token in sources and in the prompt
makes every position of the prompt meet every anchor of the runs, most on a new diagonal; the default
is above the most anchors a position of the bench's prompts met (docs/design.md).

min_len is the caller's: 64 is the smallest the defaults guarantee (guaranteed_len is 63), well above
chance (unrelated texts share far shorter runs: docs/design.md) and above the chat template
and its short boilerplate, so what is found is pasted content; whether shorter spans are worth
splicing (each is a seam the repair must mend) is a question for the model, not measured here.

Why the prompt is scanned at every position rather than cut into chunks too: matching chunk to chunk
would cost a lookup per chunk instead of one per token, but finds a span only once the prompt's
chunking has fallen onto the source's cut points inside it, which is likely and never certain
(chunking.py): measured, it misses some of the quoted sentences the scan finds
(bench/results/chunking.md). The scan costs about as much as chunking the prompt: both touch every
token once in Python.

Why anchors at chunk starts: the guarantee needs only a bounded gap between anchors, which a fixed
stride of max_len tokens would give with fewer of them (one per 48 tokens, not per 20: ~3 bytes a
token less). Content-defined anchors fall on the same tokens of a passage in every source that holds
it, whatever precedes it, which keeps matching chunks alone possible (the bench's other lookup) if
the scan's cost ever mattered.

The fingerprint is Python's hash of the tokens' bytes (SipHash, keyed per process): fast, and not
predictable by a client, which keeps buckets short. It need not be collision-free, since every hit
is verified. Namespaces (model, cache salt) each have their own table, so tenants never meet, not
even in a bucket.

Memory: a copy of each source's tokens (int32, 4 bytes a token, for verification) and one anchor per
chunk: ~9 bytes per indexed token, measured with tracemalloc (bench/results/chunking.md), against
~36 KB of float32 KV per token on the default model.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_right, insort
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvsplice.reuse.chunking import ChunkSizes, chunk_ends

# Bytes per token in the copies of sources and prompts (int32: every vocabulary fits).
_TOKEN_BYTES = 4
# An anchor is (source id << _OFFSET_BITS) | offset, one int: the index holds many of them.
_OFFSET_BITS = 32


class SpanMatch(NamedTuple):
    """Prompt tokens [start, end) equal the source's tokens [source_start, source_start + end - start)."""

    start: int
    end: int
    source: Hashable
    source_start: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class _Source:
    handle: Hashable
    namespace: Hashable
    # Issued in order of addition: a larger id is a more recent source.
    id: int
    # The token ids as int32 bytes.
    data: bytes
    # The offsets of its anchors (the starts of its chunks that have anchor_len tokens after them).
    anchors: array[int]


class _Candidate(NamedTuple):
    """A common span, ordered for the greedy choice: longest first, then the most recent source."""

    neg_length: int
    neg_source_id: int
    start: int
    source_start: int


class SpanIndex:
    def __init__(
        self,
        sizes: ChunkSizes | None = None,
        anchor_len: int = 16,
        max_hits: int = 64,
        fingerprint: Callable[[bytes], int] = hash,
    ) -> None:
        """sizes: the chunking that places anchors (ChunkSizes() by default).
        anchor_len: tokens fingerprinted per anchor.
        max_hits: the most anchors (the newest) one prompt position is checked against.
        fingerprint: of anchor_len tokens' bytes (tests force collisions with it)."""
        self.sizes = sizes if sizes is not None else ChunkSizes()
        if anchor_len < 1 or max_hits < 1:
            raise ValueError(f"anchor_len and max_hits must be positive, got {anchor_len} and {max_hits}")
        self.anchor_len = anchor_len
        self.max_hits = max_hits
        self._fingerprint = fingerprint
        self._sources: dict[Hashable, _Source] = {}
        self._by_id: dict[int, _Source] = {}
        # namespace -> fingerprint -> anchors (packed ints), in order of addition.
        self._tables: dict[Hashable, dict[int, list[int]]] = {}
        self._next_id = 0
        self.num_tokens = 0
        self.num_anchors = 0

    @property
    def guaranteed_len(self) -> int:
        """`find` finds every common span at least this long (see the module docstring)."""
        return self.sizes.max_len + self.anchor_len - 1

    def __len__(self) -> int:
        return len(self._sources)

    def __contains__(self, source: Hashable) -> bool:
        return source in self._sources

    def add(self, namespace: Hashable, source: Hashable, token_ids: Sequence[int]) -> None:
        """Index token_ids, the tokens whose KV `source` holds; the index keeps a copy of them.
        A source is added once (remove it first to add it again)."""
        if source in self._sources:
            raise ValueError(f"source {source!r} is already indexed")
        data = _to_bytes(token_ids)
        n, k = len(token_ids), self.anchor_len
        starts = [0, *chunk_ends(token_ids, self.sizes)[:-1]]
        anchors = array("I", (a for a in starts if a + k <= n))
        entry = _Source(source, namespace, self._next_id, data, anchors)
        assert n < 1 << _OFFSET_BITS, "a source's offsets must fit an anchor"
        self._next_id += 1
        self._sources[source] = entry
        self._by_id[entry.id] = entry
        width, fingerprint = k * _TOKEN_BYTES, self._fingerprint
        # A namespace has a table while it has anchors.
        table = self._tables.setdefault(namespace, {}) if anchors else {}
        for a in anchors:
            key = fingerprint(data[a * _TOKEN_BYTES : a * _TOKEN_BYTES + width])
            table.setdefault(key, []).append(entry.id << _OFFSET_BITS | a)
        self.num_tokens += n
        self.num_anchors += len(anchors)

    def source_tokens(self, source: Hashable, end: int) -> list[int]:
        """The first `end` tokens of an indexed source."""
        return array("i", self._sources[source].data[: end * _TOKEN_BYTES]).tolist()

    def remove(self, source: Hashable) -> None:
        """Forget a source (its KV is gone); KeyError if it is not indexed."""
        entry = self._sources.pop(source)
        del self._by_id[entry.id]
        width, fingerprint = self.anchor_len * _TOKEN_BYTES, self._fingerprint
        table = self._tables[entry.namespace] if entry.anchors else {}
        for a in entry.anchors:
            key = fingerprint(entry.data[a * _TOKEN_BYTES : a * _TOKEN_BYTES + width])
            bucket = table[key]
            bucket.remove(entry.id << _OFFSET_BITS | a)
            if not bucket:
                del table[key]
        if entry.anchors and not table:
            del self._tables[entry.namespace]
        self.num_tokens -= len(entry.data) // _TOKEN_BYTES
        self.num_anchors -= len(entry.anchors)

    def find(self, namespace: Hashable, token_ids: Sequence[int], min_len: int) -> list[SpanMatch]:
        """Spans of token_ids equal to spans of sources in `namespace`, each at least min_len tokens,
        not overlapping, in prompt order. Each is the longest common span with its source around the
        anchor that found it, cut back only where a longer span chosen before it overlaps. Changes
        nothing. Every common span of >= max(min_len, guaranteed_len) tokens is covered but for
        stretches shorter than min_len, where a longer span overlaps it (unless max_hits cut the scan)."""
        if min_len < 1:
            raise ValueError(f"min_len must be positive, got {min_len}")
        table = self._tables.get(namespace)
        k = self.anchor_len
        if table is None or len(token_ids) < k:
            return []
        data = _to_bytes(token_ids)
        width, fingerprint = k * _TOKEN_BYTES, self._fingerprint
        keys = [fingerprint(data[j : j + width]) for j in range(0, len(data) - width + 1, _TOKEN_BYTES)]
        # (source id, source offset - prompt offset) -> where the last span found on that diagonal ends.
        reach: dict[tuple[int, int], int] = {}
        candidates: list[_Candidate] = []
        for i, key in enumerate(keys):
            bucket = table.get(key)
            if bucket is None:
                continue
            for anchor in bucket[-self.max_hits :]:
                source_id, a = anchor >> _OFFSET_BITS, anchor & ((1 << _OFFSET_BITS) - 1)
                diagonal = (source_id, a - i)
                if reach.get(diagonal, -1) > i:
                    continue  # inside a span already found: spans on a diagonal are maximal, so disjoint
                source = self._by_id[source_id]
                a_byte, i_byte = a * _TOKEN_BYTES, i * _TOKEN_BYTES
                if source.data[a_byte : a_byte + width] != data[i_byte : i_byte + width]:
                    continue  # a fingerprint collision
                back = _common_suffix_len(data, i, source.data, a)
                end = i + k + _common_prefix_len(data, i + k, source.data, a + k)
                reach[diagonal] = end
                if end - (i - back) >= min_len:
                    candidates.append(_Candidate(i - back - end, -source_id, i - back, a - back))
        return self._choose(candidates, min_len)

    def check_invariants(self) -> None:
        """Assert that the tables hold exactly the live sources' anchors at their chunk starts (tests)."""
        expected: dict[tuple[Hashable, int], list[int]] = {}
        num_tokens = num_anchors = 0
        width = self.anchor_len * _TOKEN_BYTES
        for handle, entry in self._sources.items():
            assert entry.handle == handle and self._by_id[entry.id] is entry
            n = len(entry.data) // _TOKEN_BYTES
            token_ids = array("i", entry.data)
            starts = [0, *chunk_ends(token_ids, self.sizes)[:-1]]
            assert list(entry.anchors) == [a for a in starts if a + self.anchor_len <= n]
            for a in entry.anchors:
                key = self._fingerprint(entry.data[a * _TOKEN_BYTES : a * _TOKEN_BYTES + width])
                expected.setdefault((entry.namespace, key), []).append(entry.id << _OFFSET_BITS | a)
            num_tokens += n
            num_anchors += len(entry.anchors)
        assert len(self._by_id) == len(self._sources)
        assert all(self._tables.values()), "a namespace without anchors keeps no table"
        actual = {(ns, key): bucket for ns, table in self._tables.items() for key, bucket in table.items()}
        assert actual == expected, "the tables disagree with the sources"
        assert (self.num_tokens, self.num_anchors) == (num_tokens, num_anchors)

    def _choose(self, candidates: list[_Candidate], min_len: int) -> list[SpanMatch]:
        """Greedy by length: take the longest candidate; one that overlaps spans taken goes back in as
        its uncovered pieces of >= min_len tokens (each still a common span with its source)."""
        heapq.heapify(candidates)
        taken: list[tuple[int, int, int, int]] = []  # (start, end, source id, source start), by start
        starts: list[int] = []
        while candidates:
            neg_length, neg_source_id, start, source_start = heapq.heappop(candidates)
            end = start - neg_length
            pieces = _uncovered(taken, starts, start, end)
            if pieces == [(start, end)]:
                insort(taken, (start, end, -neg_source_id, source_start))
                starts.insert(bisect_right(starts, start), start)
                continue
            for piece_start, piece_end in pieces:
                if piece_end - piece_start >= min_len:
                    shifted = source_start + piece_start - start
                    heapq.heappush(
                        candidates, _Candidate(piece_start - piece_end, neg_source_id, piece_start, shifted)
                    )
        matches: list[SpanMatch] = []
        for start, end, source_id, source_start in taken:
            assert not matches or matches[-1].end <= start, "chosen spans overlap"
            matches.append(SpanMatch(start, end, self._by_id[source_id].handle, source_start))
        return matches


def _to_bytes(token_ids: Sequence[int]) -> bytes:
    data = array("i", token_ids)
    assert data.itemsize == _TOKEN_BYTES
    return data.tobytes()


def _uncovered(
    taken: list[tuple[int, int, int, int]], starts: list[int], start: int, end: int
) -> list[tuple[int, int]]:
    """The stretches of [start, end) that no taken span covers."""
    pieces = []
    pos = start
    j = bisect_right(starts, start) - 1
    if j >= 0:
        pos = max(pos, taken[j][1])
    j += 1
    while j < len(taken) and taken[j][0] < end:
        if taken[j][0] > pos:
            pieces.append((pos, taken[j][0]))
        pos = max(pos, taken[j][1])
        j += 1
    if pos < end:
        pieces.append((pos, end))
    return pieces


def _common_prefix_len(x: bytes, i: int, y: bytes, j: int) -> int:
    """Equal tokens at the start of x[i:] and y[j:] (offsets in tokens), compared in galloping slices."""
    tb = _TOKEN_BYTES
    limit = min(len(x) // tb - i, len(y) // tb - j)
    x0, y0 = i * tb, j * tb
    n, step = 0, 16
    while n + step <= limit:
        if x[x0 + n * tb : x0 + (n + step) * tb] != y[y0 + n * tb : y0 + (n + step) * tb]:
            break
        n += step
        step *= 2
    # The first n tokens are equal; the first difference, if any, is before min(n + step, limit).
    hi = min(n + step, limit)
    while n < hi:
        mid = (n + hi + 1) // 2
        if x[x0 + n * tb : x0 + mid * tb] == y[y0 + n * tb : y0 + mid * tb]:
            n = mid
        else:
            hi = mid - 1
    return n


def _common_suffix_len(x: bytes, i: int, y: bytes, j: int) -> int:
    """Equal tokens at the end of x[:i] and y[:j] (offsets in tokens), compared in galloping slices."""
    tb = _TOKEN_BYTES
    limit = min(i, j)
    x1, y1 = i * tb, j * tb
    n, step = 0, 16
    while n + step <= limit:
        if x[x1 - (n + step) * tb : x1 - n * tb] != y[y1 - (n + step) * tb : y1 - n * tb]:
            break
        n += step
        step *= 2
    hi = min(n + step, limit)
    while n < hi:
        mid = (n + hi + 1) // 2
        if x[x1 - mid * tb : x1 - n * tb] == y[y1 - mid * tb : y1 - n * tb]:
            n = mid
        else:
            hi = mid - 1
    return n
