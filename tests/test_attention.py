"""The attention primitive against a brute-force oracle written from the definition."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.kv import attention
from kvsplice.kv.attention import NO_KEY, attend


def oracle(q, q_pos, k, v, k_pos, scale, window):
    """Loop over every (sequence, query, head): softmax over the visible keys by the definition."""
    batch, tokens, heads, _ = q.shape
    group = heads // k.shape[2]
    out = torch.zeros_like(q, dtype=torch.float64)
    for b in range(batch):
        for t in range(tokens):
            qp = int(q_pos[b, t])
            visible = [
                s
                for s in range(k.shape[1])
                if int(k_pos[b, s]) <= qp and (window is None or qp - int(k_pos[b, s]) < window)
            ]
            for h in range(heads):
                scores = [float(q[b, t, h].double() @ k[b, s, h // group].double()) * scale for s in visible]
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights)
                for w, s in zip(weights, visible, strict=True):
                    out[b, t, h] += w / total * v[b, s, h // group].double()
    return out.float()


@settings(max_examples=40, deadline=None)
@given(
    seq_len=st.integers(1, 40),
    batch=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    window=st.one_of(st.none(), st.integers(1, 12)),
    data=st.data(),
)
def test_attend_matches_oracle(seq_len, batch, kv_heads, group, window, data) -> None:
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    dim = 8
    # Keys: each sequence has its own length; the rest is padding.
    lengths = [data.draw(st.integers(1, seq_len)) for _ in range(batch)]
    k_pos = torch.full((batch, seq_len), NO_KEY, dtype=torch.int64)
    for b, n in enumerate(lengths):
        k_pos[b, :n] = torch.arange(n)
    # Queries: a sorted subset of each sequence's positions that includes its last one.
    tokens = data.draw(st.integers(1, min(lengths)))
    rows = []
    for n in lengths:
        earlier = (
            data.draw(st.sets(st.integers(0, n - 2), min_size=tokens - 1, max_size=tokens - 1))
            if n > 1
            else set()
        )
        rows.append(sorted(earlier | {n - 1}))
    q_pos = torch.tensor(rows)
    q = torch.randn(batch, q_pos.shape[1], kv_heads * group, dim, generator=gen)
    k = torch.randn(batch, seq_len, kv_heads, dim, generator=gen)
    v = torch.randn(batch, seq_len, kv_heads, dim, generator=gen)
    got = attend(q, q_pos, k, v, k_pos, scale=0.3, window=window)
    torch.testing.assert_close(got, oracle(q, q_pos, k, v, k_pos, 0.3, window), atol=1e-5, rtol=1e-4)


def test_tiling_reads_only_visible_keys_and_matches(monkeypatch) -> None:
    """Queries processed in several tiles (a long prefill) give the same result as one tile."""
    gen = torch.Generator().manual_seed(0)
    n = 70
    q, k, v = (torch.randn(1, n, 2, 8, generator=gen) for _ in range(3))
    pos = torch.arange(n)[None]
    sub = torch.tensor([[0, 5, 9, 33, 34, 50, 69]])
    for window in (None, 7):
        whole = attend(q[:, sub[0]], sub, k, v, pos, scale=0.5, window=window)
        monkeypatch.setattr(attention, "QUERY_TILE", 3)
        monkeypatch.setattr(attention, "WINDOWED_QUERY_TILE", 2)
        tiled = attend(q[:, sub[0]], sub, k, v, pos, scale=0.5, window=window)
        monkeypatch.undo()
        torch.testing.assert_close(tiled, whole)
        torch.testing.assert_close(
            whole, oracle(q[:, sub[0]], sub, k, v, pos, 0.5, window), atol=1e-5, rtol=1e-4
        )
