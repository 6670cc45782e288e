"""The segment shift (repair/shift.py), without a model: a shift shared by a segment's tokens (in the
keys before RoPE, in the values) is recovered from the recomputed ones and moved onto the rest, with
RoPE written out here as a rotation of complex pairs, independently of kvsplice.kv.rope."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.models.runner import ForwardResult
from kvsplice.repair.shift import MIN_SAMPLE, SegmentShift, median
from kvsplice.reuse.work import Pass, PrefillWork

H, D = 2, 8
FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))  # [D/2]
KIND = "global"


def _rotate(x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor = FREQ) -> torch.Tensor:
    """RoPE with halves as the real and imaginary parts: x [N, H, D] at positions [N]."""
    angle = positions.double()[:, None] * freq.double()[None]  # [N, D/2]
    z = torch.complex(x[..., : D // 2].double(), x[..., D // 2 :].double())
    z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1).float()


def _setup(n: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    true_k = torch.randn(n, H, D, generator=g)  # before RoPE
    true_v = torch.randn(n, H, D, generator=g)
    ck, cv = torch.randn(H, D, generator=g), torch.randn(H, D, generator=g)
    positions = torch.arange(n)
    # The pool holds each position's moved KV, off by the shared error (ck, cv) from the true one.
    pool_k = _rotate(true_k - ck, positions)
    pool_v = true_v - cv
    return true_k, true_v, pool_k, pool_v, positions, (ck, cv)


def _shift(scale: float, segments: list[tuple[int, ...]], own, layers: int = 1, **fresh) -> SegmentShift:
    """A pass's shift that recomputes `own` (a tensor or positions) on `layers` layers, nothing fresh
    unless `fresh` gives a layer's (as fresh0=...)."""
    positions = frozenset(own.tolist() if isinstance(own, torch.Tensor) else own)
    return SegmentShift(
        scale,
        segments,
        own=positions,
        fresh={layer: frozenset(fresh.get(f"fresh{layer}", ())) for layer in range(layers)},
    )


def test_a_shared_error_is_moved_onto_the_other_tokens() -> None:
    true_k, true_v, pool_k, pool_v, positions, _ = _setup()
    segment = tuple(range(2, 18))
    chunk = torch.tensor([3, 5, 8, 11, 19])  # 4 of the segment's tokens and one computed token
    k, v = _rotate(true_k[chunk], chunk), true_v[chunk]
    _shift(1.0, [segment], chunk).apply(0, chunk, positions, k, v, pool_k, pool_v, FREQ, KIND)
    rest = [p for p in segment if p not in chunk.tolist()]
    torch.testing.assert_close(pool_k[rest], _rotate(true_k[rest], torch.tensor(rest)), atol=1e-5, rtol=0)
    torch.testing.assert_close(pool_v[rest], true_v[rest], atol=1e-5, rtol=0)
    # Outside the segment, and the recomputed tokens' slots (the chunk writes them next), nothing moves.
    _, _, before_k, before_v, _, _ = _setup()
    untouched = [0, 1, 3, 5, 8, 11, 18, 19]
    torch.testing.assert_close(pool_k[untouched], before_k[untouched], atol=0, rtol=0)
    torch.testing.assert_close(pool_v[untouched], before_v[untouched], atol=0, rtol=0)


def test_the_scale_moves_part_of_the_way() -> None:
    true_k, true_v, pool_k, pool_v, positions, (ck, cv) = _setup(seed=1)
    chunk = torch.tensor([0, 1, 2, 3])
    _shift(0.5, [tuple(range(10))], chunk).apply(
        0, chunk, positions, _rotate(true_k[chunk], chunk), true_v[chunk], pool_k, pool_v, FREQ, KIND
    )
    # Half the shared error is left on the other tokens, in the keys before RoPE and in the values.
    left_k = true_k[4:10] - _rotate(pool_k[4:10], -torch.arange(4, 10))
    torch.testing.assert_close(left_k, (ck / 2).expand_as(left_k), atol=1e-5, rtol=0)
    left_v = true_v[4:10] - pool_v[4:10]
    torch.testing.assert_close(left_v, (cv / 2).expand_as(left_v), atol=1e-5, rtol=0)


def test_too_small_a_sample_and_fresh_tokens_are_left_alone_once_per_layer() -> None:
    true_k, true_v, pool_k, pool_v, positions, _ = _setup(seed=2)
    _, _, before_k, before_v, _, _ = _setup(seed=2)
    segment = tuple(range(2, 18))
    few = torch.arange(2, 2 + MIN_SAMPLE - 1)
    _shift(1.0, [segment], few).apply(
        0, few, positions, _rotate(true_k[few], few), true_v[few], pool_k, pool_v, FREQ, KIND
    )
    assert torch.equal(pool_k, before_k) and torch.equal(pool_v, before_v)
    chunk = torch.arange(5, 5 + MIN_SAMPLE)
    shift = _shift(1.0, [segment], chunk, layers=2, fresh0={15, 16})
    shift.apply(0, chunk, positions, _rotate(true_k[chunk], chunk), true_v[chunk], pool_k, pool_v, FREQ, KIND)
    # Recomputed on this layer by an earlier pass: left alone; the others are moved.
    assert torch.equal(pool_v[[15, 16]], before_v[[15, 16]])
    torch.testing.assert_close(pool_v[[2, 3, 4, 9, 17]], true_v[[2, 3, 4, 9, 17]], atol=1e-5, rtol=0)
    moved = pool_v.clone()
    shift.apply(
        0, chunk, positions, _rotate(true_k[chunk], chunk) + 1, true_v[chunk] + 1, pool_k, pool_v, FREQ, KIND
    )
    assert torch.equal(pool_v, moved), "once per layer and segment"
    shift.apply(
        1, chunk, positions, _rotate(true_k[chunk], chunk), true_v[chunk] + 1, pool_k, pool_v, FREQ, KIND
    )
    assert not torch.equal(pool_v, moved), "another layer is shifted on its own"


def test_a_pass_names_the_samples_its_chunks_must_not_cut_and_refuses_a_cut_one() -> None:
    true_k, true_v, pool_k, pool_v, positions, _ = _setup(seed=3)
    first, second = (2, 5, 7, 9), (12, 13, 14, 15)
    # A sample per segment, a segment with too few recomputed tokens, one with nothing left to shift
    # on any layer (every other token fresh there), and one with something left on one layer.
    shift = _shift(1.0, [tuple(range(2, 11)), tuple(range(11, 16))], [*first, *second, 19], layers=2)
    assert shift.whole() == [(2, 9), (12, 15)]
    few = _shift(1.0, [tuple(range(2, 11))], [2, 5, 7])
    assert few.whole() == []
    rest = {3, 4, 6, 8, 10}
    spent = _shift(1.0, [tuple(range(2, 11))], first, layers=2, fresh0=rest, fresh1=rest)
    assert spent.whole() == []
    half = _shift(1.0, [tuple(range(2, 11))], first, layers=2, fresh0=rest)
    assert half.whole() == [(2, 9)]
    cut = torch.tensor([2, 5])
    with pytest.raises(AssertionError, match="cuts no sample"):
        shift.apply(0, cut, positions, _rotate(true_k[cut], cut), true_v[cut], pool_k, pool_v, FREQ, KIND)


def test_a_few_outlying_errors_do_not_move_the_shift() -> None:
    true_k, true_v, pool_k, pool_v, positions, _ = _setup(seed=4)
    chunk = torch.arange(0, 5)
    k, v = _rotate(true_k[chunk], chunk), true_v[chunk].clone()
    # One recomputed token's value error is far from the shared one (a mean would take a fifth of it).
    v[2] += 100.0
    _shift(1.0, [tuple(range(12))], chunk).apply(0, chunk, positions, k, v, pool_k, pool_v, FREQ, KIND)
    torch.testing.assert_close(pool_v[5:12], true_v[5:12], atol=1e-5, rtol=0)
    torch.testing.assert_close(pool_k[5:12], _rotate(true_k[5:12], torch.arange(5, 12)), atol=1e-5, rtol=0)


def test_each_rope_kind_moves_keys_by_its_own_frequencies() -> None:
    """Two layers of one pass with different RoPE (Gemma 3's local and global layers): each recovers
    the shared key error with its own frequencies, though the shift computes each kind's angles once."""
    local = FREQ * 0.37
    segment = tuple(range(2, 18))
    chunk = torch.tensor([3, 5, 8, 11])
    rest = [p for p in segment if p not in chunk.tolist()]
    shift = _shift(1.0, [segment], chunk, layers=3)
    for layer, (freq, kind) in enumerate([(FREQ, KIND), (local, "local"), (FREQ, KIND)]):
        g = torch.Generator().manual_seed(10 + layer)
        true_k, shared = torch.randn(20, H, D, generator=g), torch.randn(H, D, generator=g)
        positions = torch.arange(20)
        pool_k, pool_v = _rotate(true_k - shared, positions, freq), torch.zeros(20, H, D)
        k = _rotate(true_k[chunk], chunk, freq)
        shift.apply(layer, chunk, positions, k, torch.zeros(4, H, D), pool_k, pool_v, freq, kind)
        torch.testing.assert_close(
            pool_k[rest], _rotate(true_k[rest], torch.tensor(rest), freq), atol=1e-5, rtol=0
        )


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 40), width=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_the_median_is_quantile_one_half(n: int, width: int, seed: int) -> None:
    """median() against torch.quantile(0.5) (the mean of the two middle values where n is even), with ties."""
    x = torch.randint(-3, 4, (n, 2, width), generator=torch.Generator().manual_seed(seed)).float() / 3
    torch.testing.assert_close(median(x), torch.quantile(x, 0.5, dim=0), atol=1e-6, rtol=0)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_chunks_of_a_pass_with_the_shift_never_cut_a_sample(data: st.DataObject) -> None:
    """Chunk by chunk at random grants, a pass's chunks end anywhere but inside a sample (brute force:
    every chunk holds all or none of each sample), hold at most the grant unless a sample that starts
    the chunk is longer, and then exactly that sample."""
    size = data.draw(st.integers(8, 60))
    cuts = sorted(data.draw(st.sets(st.integers(1, size - 1), max_size=6)))
    bounds = list(zip([0, *cuts], [*cuts, size], strict=True))
    segments = [tuple(range(a, b)) for a, b in bounds]
    own = frozenset(p for p in range(size) if data.draw(st.booleans()))
    shift = _shift(1.0, segments, own | {size})
    positions = tuple(sorted(own | {size}))  # the question's last token after the segments
    work = PrefillWork(
        range(8), [1] * (size + 1), Pass(positions, range(1), shift=shift), 1, need_logits=False
    )
    samples = [set(positions[positions.index(a) : positions.index(b) + 1]) for a, b in shift.whole()]
    while not work.done:
        grant = data.draw(st.integers(1, 12))
        tokens = work.chunk_tokens(grant)
        chunk = work.next_chunk(grant)
        assert len(chunk.positions) == tokens
        held = set(chunk.positions)
        assert all(sample <= held or not sample & held for sample in samples)
        if tokens > grant:
            assert any(sample <= held and chunk.positions[0] == min(sample) for sample in samples)
            assert tokens == max(len(s) for s in samples if chunk.positions[0] == min(s))
        work.complete(chunk, ForwardResult(None, torch.zeros(tokens, 4), 0.0))
