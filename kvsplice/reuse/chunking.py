"""Content-defined chunking of token ids: a passage is cut at the same places wherever it appears.

FastCDC (Xia et al., USENIX ATC 2016) over token ids instead of bytes. A gear hash rolls over the
tokens, h = (h << 1) + GEAR[token]; a chunk ends after the first token whose hash has zeros under a
mask, looked for from `min_len` tokens into the chunk: under a strict mask until `avg_len` tokens,
under a loose one after (normalized chunking: at level `normalization` the masks have that many bits
more and fewer than log2(avg_len), which narrows the spread of lengths around the average), and
unconditionally at `max_len` tokens or at the end of the sequence.

Two departures from the byte version make the cut points a function of nearby content only:
- The masks use only the `window` lowest bits of the hash (window = the strict mask's bit count). A
  left-shifting hash's bit k depends on the last k + 1 tokens alone, so whether a token ends a chunk
  depends on the `window` tokens ending at it, and on nothing before them.
- Each chunk's hash starts `window` tokens before the first place it may cut (FastCDC starts it at that
  place, so its first tests see a single byte). Since window <= min_len, the chunking after a cut
  depends only on the tokens after it: two sequences that share a passage and both cut at one place
  inside it cut at the same places from there to the passage's end. Inside a shared passage the
  candidate cut points agree once `window` tokens of it have gone by; the two chunkings, which differ
  only in where their last cut was, then fall onto a common cut within a chunk or two in practice
  (bench/results/chunking.md), but nothing bounds that (a stretch with no candidate is cut at
  max_len, wherever the last cut was), which is why the span index does not rely on it.

Chunking is prefix-stable: the cuts of tokens[:m] are the cuts of tokens below m, then m.

Defaults (ChunkSizes()): 8 / 16 / 48 tokens at normalization 1, from bench/results/chunking.md
(MuSiQue and synthetic passages pasted into new prompts, tokenized for Gemma 3; docs/design.md says
why):
- max_len sets what the span index finds for certain: with its 16-token anchors, every span of
  max_len + 15 = 63 tokens, under the min_len of 64 it recommends.
- Under that cap, small chunks lightly normalized fall into step fastest after the start of a shared
  span, and fail to in the fewest spans, so matching chunks alone, without the index's scan, finds
  the most of quoted sentences.
- The index keeps one anchor per chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

# The gear table: 2**16 64-bit values, from SHAKE-256 of a fixed label so every process and machine
# cuts alike. A token id indexes it modulo 2**16: ids 2**16 apart look alike to the chunker, which
# only decides where to cut.
_GEAR_INDEX_BITS = 16
_GEAR_BYTES = hashlib.shake_256(b"kvsplice.chunking.gear.v1").digest(8 << _GEAR_INDEX_BITS)
GEAR: tuple[int, ...] = tuple(
    int.from_bytes(_GEAR_BYTES[8 * i : 8 * i + 8], "little") for i in range(1 << _GEAR_INDEX_BITS)
)
_GEAR_INDEX_MASK = (1 << _GEAR_INDEX_BITS) - 1


@dataclass(frozen=True)
class ChunkSizes:
    """Chunk lengths in tokens: every chunk but a sequence's last has min_len .. max_len tokens."""

    min_len: int = 8
    # A power of two: the masks have log2(avg_len) +- normalization bits.
    avg_len: int = 16
    max_len: int = 48
    # FastCDC's normalization level: 0 is one mask; each level narrows the spread of lengths.
    normalization: int = 1

    def __post_init__(self) -> None:
        bits = self.avg_len.bit_length() - 1
        if self.avg_len & (self.avg_len - 1) or not 0 <= self.normalization < bits:
            raise ValueError(
                f"avg_len must be a power of two above 2**normalization, got {self.avg_len} and "
                f"normalization {self.normalization}"
            )
        if not self.window <= self.min_len < self.avg_len < self.max_len:
            raise ValueError(
                f"need {self.window} <= min_len < avg_len < max_len "
                f"(the hash window of avg_len {self.avg_len} is {self.window} tokens), got {self}"
            )

    @property
    def window(self) -> int:
        """The tokens a cut decision reads: the strict mask's bit count."""
        return self.avg_len.bit_length() - 1 + self.normalization

    @property
    def loose_mask(self) -> int:
        # The top bits of the window: each mixes the most tokens.
        bits = self.avg_len.bit_length() - 1 - self.normalization
        return ((1 << bits) - 1) << (self.window - bits)


def chunk_ends(tokens: Sequence[int], sizes: ChunkSizes) -> list[int]:
    """Where each chunk of `tokens` ends (exclusive), in order; the last is len(tokens) ([] if empty)."""
    n = len(tokens)
    gear, index_mask = GEAR, _GEAR_INDEX_MASK
    window = sizes.window
    # The hash is kept to the window's bits: higher bits never reach the masks (shifts only move up).
    strict = (1 << window) - 1
    loose = sizes.loose_mask
    ends: list[int] = []
    start = 0
    while start < n:
        limit = min(start + sizes.max_len, n)
        end = limit
        first = start + sizes.min_len - 1  # the first token a chunk may end after
        if first < limit - 1:
            h = 0
            for i in range(first - window + 1, first):
                h = ((h << 1) + gear[tokens[i] & index_mask]) & strict
            normal = min(start + sizes.avg_len - 1, limit - 1)
            cut = -1
            for i in range(first, normal):
                h = ((h << 1) + gear[tokens[i] & index_mask]) & strict
                if not h:
                    cut = i
                    break
            else:
                for i in range(normal, limit - 1):
                    h = ((h << 1) + gear[tokens[i] & index_mask]) & strict
                    if not h & loose:
                        cut = i
                        break
            if cut >= 0:
                end = cut + 1
        assert start < end <= start + sizes.max_len
        ends.append(end)
        start = end
    return ends
