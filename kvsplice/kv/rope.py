"""Rotary position embeddings, and moving cached keys to new positions.

Keys are stored in the KV pool *after* RoPE, at the absolute position they were computed for.
That keeps decode cheap (no key is rotated twice on use) and makes moving a cached key exact in
structure: RoPE rotates each pair of channels by angle pos * inv_freq, rotations compose, so a
key computed at position p is moved to position p + d by rotating it once more by d * inv_freq
(`rotate_by`). All supported RoPE variants (default, linear, llama3) only change inv_freq, so this
holds for each of them; a variant that also scales cos/sin (YaRN's attention factor) would not
compose and is rejected when the config is read.

Pairs are (x[i], x[i + d/2]) ("rotate half"), as in the Hugging Face checkpoints.
"""

from __future__ import annotations

import math

import torch

from kvsplice.model_config import RopeSpec


def inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies for one layer type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    freq = 1.0 / (spec.theta**exponents)
    scaling = spec.scaling_dict()
    kind = scaling.get("rope_type")
    if kind == "linear":
        return freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > old_len / low, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    assert kind is None, f"unhandled rope type {kind}"
    return freq


def cos_sin(positions: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [...] int64 -> cos, sin: [..., head_dim] float32."""
    angles = positions.to(torch.float32)[..., None] * freq.to(positions.device)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, D] (broadcast over heads)."""
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_by(keys: torch.Tensor, delta: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """Move post-RoPE keys by `delta` positions. keys: [N, H, D]; delta: [N] int64 -> [N, H, D].

    Computed in float32 whatever the storage dtype, so a stored low-precision key loses nothing more.
    """
    return rotate(keys, *cos_sin(delta, freq))


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate_by` with the angles' cos and sin ([N, D], from `cos_sin`) given: keys [N, H, D] -> same."""
    moved = apply(keys.to(torch.float32)[None], cos[None], sin[None])[0]
    return moved.to(keys.dtype)
