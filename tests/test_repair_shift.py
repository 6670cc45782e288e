"""The segment shift (repair/shift.py), without a model: a shift shared by a segment's tokens (in the
keys before RoPE, in the values) is recovered from the recomputed ones and moved onto the rest, with
RoPE written out here as a rotation of complex pairs, independently of kvsplice.kv.rope."""

from __future__ import annotations

import torch

from kvsplice.repair.shift import MIN_SAMPLE, SegmentShift

H, D = 2, 8
FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))  # [D/2]


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE with halves as the real and imaginary parts: x [N, H, D] at positions [N]."""
    angle = positions.double()[:, None] * FREQ.double()[None]  # [N, D/2]
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


def test_a_shared_error_is_moved_onto_the_other_tokens() -> None:
    true_k, true_v, pool_k, pool_v, positions, _ = _setup()
    segment = tuple(range(2, 18))
    chunk = torch.tensor([3, 5, 8, 11, 19])  # 4 of the segment's tokens and one computed token
    k, v = _rotate(true_k[chunk], chunk), true_v[chunk]
    SegmentShift(1.0, [segment]).apply(0, chunk, positions, k, v, pool_k, pool_v, FREQ)
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
    SegmentShift(0.5, [tuple(range(10))]).apply(
        0, chunk, positions, _rotate(true_k[chunk], chunk), true_v[chunk], pool_k, pool_v, FREQ
    )
    # Half the shared error is left on the other tokens, in the keys before RoPE and in the values.
    left_k = true_k[4:10] - _rotate(pool_k[4:10], -torch.arange(4, 10))
    torch.testing.assert_close(left_k, (ck / 2).expand_as(left_k), atol=1e-5, rtol=0)
    left_v = true_v[4:10] - pool_v[4:10]
    torch.testing.assert_close(left_v, (cv / 2).expand_as(left_v), atol=1e-5, rtol=0)


def test_too_small_a_sample_fresh_tokens_and_a_second_chunk_leave_the_kv_alone() -> None:
    true_k, true_v, pool_k, pool_v, positions, _ = _setup(seed=2)
    segment = tuple(range(2, 18))
    few = torch.arange(2, 2 + MIN_SAMPLE - 1)
    shift = SegmentShift(1.0, [segment], fresh={0: frozenset({15, 16})})
    shift.apply(0, few, positions, _rotate(true_k[few], few), true_v[few], pool_k, pool_v, FREQ)
    _, _, before_k, before_v, _, _ = _setup(seed=2)
    assert torch.equal(pool_k, before_k) and torch.equal(pool_v, before_v)
    chunk = torch.arange(5, 5 + MIN_SAMPLE)
    shift.apply(0, chunk, positions, _rotate(true_k[chunk], chunk), true_v[chunk], pool_k, pool_v, FREQ)
    # Recomputed on this layer by an earlier pass: left alone; the others are moved.
    assert torch.equal(pool_v[[15, 16]], before_v[[15, 16]])
    torch.testing.assert_close(pool_v[[2, 3, 4, 9, 17]], true_v[[2, 3, 4, 9, 17]], atol=1e-5, rtol=0)
    moved = pool_v.clone()
    later = torch.arange(10, 10 + MIN_SAMPLE)
    shift.apply(
        0, later, positions, _rotate(true_k[later], later) + 1, true_v[later] + 1, pool_k, pool_v, FREQ
    )
    assert torch.equal(pool_v, moved), "once per layer and segment"
    shift.apply(1, later, positions, _rotate(true_k[later], later), true_v[later], pool_k, pool_v, FREQ)
    assert not torch.equal(pool_v, moved), "another layer is shifted on its own"


def test_tokens_an_earlier_chunk_of_the_pass_recomputed_are_left_alone() -> None:
    true_k, true_v, pool_k, pool_v, positions, _ = _setup(seed=3)
    segment = tuple(range(2, 18))
    first, second = torch.tensor([2, 3]), torch.arange(10, 10 + MIN_SAMPLE)
    shift = SegmentShift(1.0, [segment], own=frozenset([*first.tolist(), *second.tolist()]))
    shift.apply(0, first, positions, _rotate(true_k[first], first), true_v[first], pool_k, pool_v, FREQ)
    # The first chunk writes its own KV (the attention does, after the shift).
    pool_k[first], pool_v[first] = _rotate(true_k[first], first), true_v[first]
    shift.apply(0, second, positions, _rotate(true_k[second], second), true_v[second], pool_k, pool_v, FREQ)
    torch.testing.assert_close(pool_v[[2, 3]], true_v[[2, 3]], atol=0, rtol=0)
    rest = [p for p in segment if p not in (2, 3, *second.tolist())]
    torch.testing.assert_close(pool_v[rest], true_v[rest], atol=1e-5, rtol=0)


def test_a_few_outlying_errors_do_not_move_the_shift() -> None:
    true_k, true_v, pool_k, pool_v, positions, _ = _setup(seed=4)
    chunk = torch.arange(0, 5)
    k, v = _rotate(true_k[chunk], chunk), true_v[chunk].clone()
    # One recomputed token's value error is far from the shared one (a mean would take a fifth of it).
    v[2] += 100.0
    SegmentShift(1.0, [tuple(range(12))]).apply(0, chunk, positions, k, v, pool_k, pool_v, FREQ)
    torch.testing.assert_close(pool_v[5:12], true_v[5:12], atol=1e-5, rtol=0)
    torch.testing.assert_close(pool_k[5:12], _rotate(true_k[5:12], torch.arange(5, 12)), atol=1e-5, rtol=0)
