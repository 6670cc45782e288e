"""Content-defined chunking: bounded chunks, prefix stability, and cut points that follow the content."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.reuse.chunking import GEAR, ChunkSizes, chunk_ends

# Small sizes, so that short streams hold many chunks.
SIZES = ChunkSizes(8, 16, 32)
PROPERTY = settings(max_examples=300, deadline=None)


@st.composite
def token_lists(draw: st.DrawFn, max_size: int = 300) -> list[int]:
    # Two tokens: long runs without a cut point, so many chunks are cut at max_len.
    alphabet = draw(st.sampled_from([2, 50, 1 << 18]))
    return draw(st.lists(st.integers(0, alphabet - 1), max_size=max_size))


def boundaries(tokens: list[int], offset: int, length: int) -> set[int]:
    """Chunk boundaries (0 and every chunk end) of `tokens` in [offset, offset + length], shifted to 0."""
    return {b - offset for b in [0, *chunk_ends(tokens, SIZES)] if offset <= b <= offset + length}


@PROPERTY
@given(token_lists(), st.sampled_from([SIZES, ChunkSizes(), ChunkSizes(16, 32, 64, 0)]))
def test_chunks_are_bounded(tokens: list[int], sizes: ChunkSizes) -> None:
    ends = chunk_ends(tokens, sizes)
    assert (ends[-1] if ends else 0) == len(tokens)
    for start, end in zip([0, *ends], ends, strict=False):
        assert end - start <= sizes.max_len
        assert end - start >= sizes.min_len or end == len(tokens)


@PROPERTY
@given(token_lists(), st.integers(0, 300))
def test_chunking_is_prefix_stable(tokens: list[int], m: int) -> None:
    """Cuts never look ahead: a sequence's prefix is cut where the sequence is, then at its end."""
    m = min(m, len(tokens))
    expected = [e for e in chunk_ends(tokens, SIZES) if e < m] + ([m] if m else [])
    assert chunk_ends(tokens[:m], SIZES) == expected


@PROPERTY
@given(
    st.lists(st.integers(0, 3), max_size=60),
    st.lists(st.integers(0, 3), max_size=60),
    token_lists(max_size=200),
    st.lists(st.integers(0, 3), min_size=1, max_size=5),
    st.lists(st.integers(0, 3), min_size=1, max_size=5),
)
def test_cuts_agree_after_a_common_cut(
    before_x: list[int], before_y: list[int], passage: list[int], after_x: list[int], after_y: list[int]
) -> None:
    """Where two sequences that share a passage both cut inside it, they cut alike up to its end,
    whatever surrounds it: the chunking after a cut reads only the tokens after it."""
    x = boundaries(before_x + passage + after_x, len(before_x), len(passage))
    y = boundaries(before_y + passage + after_y, len(before_y), len(passage))
    common = x & y
    if common:
        first = min(common)
        assert {b for b in x if b >= first} == {b for b in y if b >= first}


def test_cuts_resynchronise_on_random_text() -> None:
    """After different openings, the chunkings of a passage fall onto common cut points within a chunk
    or two (measured here on random tokens; nothing guarantees it, see chunking.py)."""
    rng = random.Random(0)
    sizes = ChunkSizes()
    offsets = []
    for _ in range(200):
        passage = [rng.randrange(1 << 18) for _ in range(1500)]
        x_before = [rng.randrange(1 << 18) for _ in range(rng.randrange(300))]
        y_before = [rng.randrange(1 << 18) for _ in range(rng.randrange(300))]
        x = {e - len(x_before) for e in chunk_ends(x_before + passage + [1], sizes)}
        y = {e - len(y_before) for e in chunk_ends(y_before + passage + [2], sizes)}
        common = sorted(b for b in x & y if 0 <= b < len(passage))
        assert common, "the chunkings never met inside a 1,500-token passage"
        offsets.append(common[0])
    offsets.sort()
    # Chunks average ~20 tokens: seen a median of 21.5 (about one chunk) and 90% within 47 tokens.
    assert statistics.median(offsets) <= 30
    assert offsets[int(0.9 * len(offsets))] <= 70


def test_the_gear_table_and_cuts_are_fixed() -> None:
    """Every process and machine cuts alike (the table comes from SHAKE-256 of a fixed label)."""
    assert (GEAR[0], GEAR[-1]) == (0x68FC52EB5479129, 0xABE30E39C7972670)
    tokens = [(i * 7919) % 50021 for i in range(400)]
    expected = [8, 29, 43, 61, 77, 93, 119, 130, 146, 173, 191, 207, 233, 251, 271, 288, 310, 321, 330, 348]
    assert chunk_ends(tokens, ChunkSizes()) == [*expected, 375, 392, 400]


@pytest.mark.parametrize(
    "fields",
    [
        (16, 24, 48, 2),  # avg not a power of two
        (4, 16, 32, 2),  # min below the hash window (6 tokens)
        (16, 16, 48, 2),  # min not below avg
        (16, 32, 32, 2),  # avg not below max
        (16, 32, 48, 5),  # normalization leaves the loose mask no bit
    ],
)
def test_bad_sizes_are_refused(fields: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        ChunkSizes(*fields)
