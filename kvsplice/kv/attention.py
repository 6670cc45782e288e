"""The one attention primitive of kvsplice.

Queries at arbitrary absolute positions attend to keys/values that each carry an absolute position.
A key is visible to a query when it is at or before the query's position (causal by position) and,
on sliding-window layers, fewer than `window` positions behind it. Full prefill, prefill on top of
cached KV, batched decode, and recomputing a scattered subset of tokens to repair reused KV are all
calls of this function; they differ only in which queries and which keys they pass.

Keys must be sorted by position within each sequence; padding keys carry position `NO_KEY`, larger
than any real position, so they sort last and causality alone hides them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NO_KEY = 2**62
# Queries are processed in tiles so that each tile reads only the keys it can see: on a
# sliding-window layer that is about window + tile keys instead of the whole sequence, which is why
# windowed tiles are small (docs/design.md).
QUERY_TILE = 512
WINDOWED_QUERY_TILE = 128


def visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """q_pos: [B, T], k_pos: [B, S] -> bool [B, T, S]: may query t attend to key s."""
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    visible = k <= q
    if window is not None:
        visible &= q - k < window
    return visible


def attend(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q: [B, T, Hq, D], q_pos: [B, T] sorted; k, v: [B, S, Hkv, D], k_pos: [B, S] sorted -> [B, T, Hq, D].

    Hq must be a multiple of Hkv (grouped-query attention). Every query must see at least its own
    key, which the caller guarantees by writing a token's KV before it attends.
    """
    q_heads, kv_heads = q.shape[2], k.shape[2]
    assert q_heads % kv_heads == 0, f"{q_heads} query heads over {kv_heads} kv heads"
    tokens = q.shape[1]
    if window is None and tokens == k.shape[1] and torch.equal(q_pos, k_pos):
        # A plain prefill: the mask is the causal triangle, whose upper half SDPA can skip.
        return _sdpa(q, k, v, None, scale)
    outs = []
    for start, end in _tiles(q_pos, window):
        tile_pos = q_pos[:, start:end]
        first, last = tile_pos[:, :1].contiguous(), tile_pos[:, -1:].contiguous()
        lo = 0 if window is None else int(torch.searchsorted(k_pos, first - window + 1).min())
        hi = int(torch.searchsorted(k_pos, last, right=True).max())
        mask = visibility(tile_pos, k_pos[:, lo:hi], window)
        outs.append(_sdpa(q[:, start:end], k[:, lo:hi], v[:, lo:hi], mask, scale))
    return torch.cat(outs, dim=1)


def _tiles(q_pos: torch.Tensor, window: int | None) -> list[tuple[int, int]]:
    """Consecutive query ranges of at most QUERY_TILE queries; on a windowed layer of at most
    WINDOWED_QUERY_TILE, each also spanning fewer than `window` positions, so that a sparse set of
    queries scattered over a long sequence (sparse repair) reads about 2 * window keys per tile,
    not the whole sequence."""
    tokens = q_pos.shape[1]
    if window is None or q_pos.shape[0] > 1:
        return [(start, min(start + QUERY_TILE, tokens)) for start in range(0, tokens, QUERY_TILE)]
    pos = q_pos[0]
    ends = torch.searchsorted(pos, pos + window).tolist()  # first query at or beyond each one's window span
    tiles, start = [], 0
    while start < tokens:
        end = min(ends[start], start + WINDOWED_QUERY_TILE)
        tiles.append((start, end))
        start = end
    return tiles


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [B, Hq, T, D]
        k.transpose(1, 2).to(q.dtype),  # [B, Hkv, S, D]
        v.transpose(1, 2).to(q.dtype),
        attn_mask=None if mask is None else mask[:, None],  # [B, 1, T, S]
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)  # [B, T, Hq, D]
