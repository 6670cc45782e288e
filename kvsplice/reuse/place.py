"""Placing reused KV at new positions: values are copied, keys are rotated by the position offset."""

from __future__ import annotations

import torch

from kvsplice.kv import rope
from kvsplice.kv.pool import KVPool
from kvsplice.model_config import ModelConfig


def move_kv(
    pool: KVPool,
    cfg: ModelConfig,
    freqs: dict[str, torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    delta: torch.Tensor,
) -> None:
    """Copy every layer's KV from `src_slots` to `dst_slots` ([N] each), moving keys by `delta`
    positions ([N]; keys are stored after RoPE, see kv/rope.py)."""
    assert src_slots.shape == dst_slots.shape == delta.shape
    # The angles depend on the layer's RoPE kind only (Gemma 3: two kinds over 18 layers).
    angles = {kind: rope.cos_sin(delta, freqs[kind]) for kind in set(cfg.layer_types)}
    for layer in range(cfg.num_layers):
        keys, values = pool.read(layer, src_slots)  # [N, Hkv, D]
        moved = rope.rotate(keys, *angles[cfg.layer_types[layer]])
        pool.write(layer, dst_slots, moved, values)
